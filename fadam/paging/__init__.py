"""Paged optimizer state: the inner state lives in host memory or in a file and is streamed to the device."""

from fadam.paging._aliases import (
    paged,
    paged_adam,
    paged_adam8bit,
    paged_adamw,
    paged_adamw8bit,
    paged_ademamix,
    paged_ademamix8bit,
)
from fadam.paging._storage import PagedStateFileError
from fadam.paging._wrapper import PagedState, page_state

__all__ = [
    "PagedState",
    "PagedStateFileError",
    "page_state",
    "paged",
    "paged_adam",
    "paged_adam8bit",
    "paged_adamw",
    "paged_adamw8bit",
    "paged_ademamix",
    "paged_ademamix8bit",
]
