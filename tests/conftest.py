import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
