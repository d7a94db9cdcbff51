"""The per-step leaf checks in C++: a small Python extension that ``fadam.step`` uses where it is built.

Every step checks each leaf's tensors before a kernel walks them (plain, dense, contiguous, of the kernel's dtype and
device, not recorded by autograd), that the gradients match the params, and that no two written leaves share a
storage. In Python each tensor costs 0.2-0.6 us (attribute reads through the binding, more right after a kernel has
swept the caches); read here from the tensor itself, 10-70 ns. Each function answers exactly what the Python check
it stands for answers (``tests/test_compiled_checks.py`` compares them on every kind of leaf), and only for plain
tensors (``torch.Tensor``, ``nn.Parameter``) outside ``torch.func`` transforms: for anything else it says so and the
caller checks in Python.

The extension is compiled by the system C++ compiler against the installed torch's headers and Python's, once per
machine, torch and Python, into the kernel cache (``fadam._cpu_kernel.cache_dir``). A process that finds no build
there checks in Python and starts one as it exits, in a process of its own at idle priority (10-15 s on a 2-core
machine), so that no step waits for the compiler or shares the CPU with it; the processes after it load the library.
Without a compiler or Python's headers the checks stay in Python (a failed build leaves the compiler's message beside
where the library would be, ``<name>.failed``, and is not tried again).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.machinery
import importlib.util
import platform
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

import torch
from torch._C._functorch import maybe_current_level as _current_level

_NAME = "_fadam_checks"

_SOURCE = r"""
#include <Python.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <algorithm>
#include <vector>

namespace {

PyTypeObject* tensor_type = nullptr;     // torch.Tensor
PyTypeObject* parameter_type = nullptr;  // torch.nn.Parameter
PyTypeObject* quantized_type = nullptr;  // fadam.quantization.QuantizedArray: (codes, absmax, map_id, like)
bool optimizable[256] = {};              // fadam._tree._OPTIMIZABLE, by at::ScalarType

bool plain(PyObject* o) { return Py_TYPE(o) == tensor_type || Py_TYPE(o) == parameter_type; }

// The items of a list or a tuple; raises TypeError for anything else
struct Items {
  THPObjectPtr held;
  explicit Items(PyObject* sequence) : held(PySequence_Fast(sequence, "expected a list or a tuple")) {
    if (!held) throw python_error();
  }
  Py_ssize_t size() const { return PySequence_Fast_GET_SIZE(held.get()); }
  PyObject* operator[](Py_ssize_t i) const { return PySequence_Fast_GET_ITEM(held.get(), i); }
};

const at::Tensor& unpacked(PyObject* o) { return THPVariable_Unpack(o); }

bool is_optimizable(const at::Tensor& t) { return optimizable[static_cast<int>(t.scalar_type()) & 255]; }

// fadam._execute._walkable of a plain tensor outside torch.func transforms, with its dtype and device
bool walkable(const at::Tensor& t, at::ScalarType dtype, const at::Device& where, bool grad_enabled) {
  return t.layout() == at::kStrided && !(grad_enabled && t.requires_grad()) && t.is_contiguous() &&
         t.scalar_type() == dtype && (where.is_cpu() ? t.is_cpu() : t.device() == where);
}

bool same_device(const at::Tensor& a, const at::Tensor& b) {
  return (a.is_cpu() && b.is_cpu()) || a.device() == b.device();
}

// fadam._execute._quantized_placed: codes (uint8, n long), absmax (float32, blocks long) and map id (0-d uint8)
bool quantized_placed(PyObject* q, Py_ssize_t codes_length, Py_ssize_t absmax_length, const at::Device& where,
                      bool grad_enabled) {
  if (PyTuple_GET_SIZE(q) != 4) return false;
  for (Py_ssize_t i = 0; i < 3; ++i)
    if (!plain(PyTuple_GET_ITEM(q, i))) return false;
  const at::Tensor& codes = unpacked(PyTuple_GET_ITEM(q, 0));
  const at::Tensor& absmax = unpacked(PyTuple_GET_ITEM(q, 1));
  const at::Tensor& map_id = unpacked(PyTuple_GET_ITEM(q, 2));
  // integer tensors never require grad: the CPU check reads neither codes' nor map id's requires_grad
  const bool integers_grad = !where.is_cpu() && grad_enabled;
  return walkable(codes, at::kByte, where, integers_grad) && codes.dim() == 1 && codes.numel() == codes_length &&
         walkable(absmax, at::kFloat, where, grad_enabled) && absmax.dim() == 1 && absmax.numel() == absmax_length &&
         map_id.layout() == at::kStrided && !(integers_grad && map_id.requires_grad()) &&
         (where.is_cpu() || map_id.is_contiguous()) && map_id.scalar_type() == at::kByte && map_id.dim() == 0 &&
         (where.is_cpu() ? map_id.is_cpu() : map_id.device() == where);
}

// Item ``i`` of a leaf_ready row: the param (0), its update (1) or a slot, which may be quantized
bool item_ready(PyObject* o, Py_ssize_t i, at::ScalarType dtype, const at::Device& where, bool grad_enabled,
                Py_ssize_t codes_length, Py_ssize_t absmax_length) {
  return i >= 2 && Py_TYPE(o) == quantized_type
             ? codes_length >= 0 && quantized_placed(o, codes_length, absmax_length, where, grad_enabled)
             : plain(o) && walkable(unpacked(o), dtype, where, grad_enabled);
}

// setup(torch.Tensor, torch.nn.Parameter, QuantizedArray, optimizable dtypes)
PyObject* setup(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *tensor, *parameter, *quantized, *dtypes;
  if (!PyArg_ParseTuple(args, "O!O!O!O", &PyType_Type, &tensor, &PyType_Type, &parameter, &PyType_Type, &quantized,
                        &dtypes))
    return nullptr;
  const Items found(dtypes);
  for (Py_ssize_t i = 0; i < found.size(); ++i) {
    if (!THPDtype_Check(found[i])) {
      PyErr_SetString(PyExc_TypeError, "expected torch.dtype objects");
      return nullptr;
    }
    optimizable[static_cast<int>(reinterpret_cast<THPDtype*>(found[i])->scalar_type) & 255] = true;
  }
  for (PyObject* type : {tensor, parameter, quantized}) Py_INCREF(type);
  tensor_type = reinterpret_cast<PyTypeObject*>(tensor);
  parameter_type = reinterpret_cast<PyTypeObject*>(parameter);
  quantized_type = reinterpret_cast<PyTypeObject*>(quantized);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// placed(tensors, dtype, device, grad_enabled): fadam._execute._placed outside torch.func transforms: whether every
// item is a plain dense contiguous tensor of ``dtype`` on ``device`` that autograd does not record
PyObject* placed(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *tensors, *dtype, *device;
  int grad_enabled;
  if (!PyArg_ParseTuple(args, "OO!O!p", &tensors, &THPDtypeType, &dtype, &THPDeviceType, &device, &grad_enabled))
    return nullptr;
  const at::ScalarType scalar_type = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
  const at::Device& where = reinterpret_cast<THPDevice*>(device)->device;
  const Items found(tensors);
  for (Py_ssize_t i = 0; i < found.size(); ++i)
    if (!plain(found[i]) || !walkable(unpacked(found[i]), scalar_type, where, grad_enabled)) Py_RETURN_FALSE;
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

// leaf_ready(tensors, dtype, device, grad_enabled, codes_length, absmax_length): True where fadam._execute.ready
// accepts the leaf for the common reason: the param, its update and every slot walkable tensors of the param's dtype
// on ``device``, or quantized slots placed as ``quantized_placed`` says (lengths -1: the leaf takes none); False
// where the caller must look in Python
PyObject* leaf_ready(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *tensors, *dtype, *device;
  int grad_enabled;
  Py_ssize_t codes_length, absmax_length;
  if (!PyArg_ParseTuple(args, "OO!O!pnn", &tensors, &THPDtypeType, &dtype, &THPDeviceType, &device, &grad_enabled,
                        &codes_length, &absmax_length))
    return nullptr;
  const at::ScalarType scalar_type = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
  const at::Device& where = reinterpret_cast<THPDevice*>(device)->device;
  const Items found(tensors);
  for (Py_ssize_t i = 0; i < found.size(); ++i)
    if (!item_ready(found[i], i, scalar_type, where, grad_enabled, codes_length, absmax_length)) Py_RETURN_FALSE;
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

// rows_ready(params, updates, slot_rows, grad_enabled, bits, block): per leaf, a layout code where leaf_ready accepts
// the CPU leaf ``[params[i], updates[i], *slot_rows[i]]`` of a float32, float64 or bfloat16 param of one or more
// dimensions, with quantized slots of ``bits`` in blocks of ``block`` (bits 0: none) sized for the param, as
// fadam._execute.ready asks it, else 0 (the caller asks ``ready``). The code tells the param's dtype (1, 2, 3 for
// float32, float64, bfloat16) plus 4 times the mask of the quantized slots: leaves of one code share a layout
PyObject* rows_ready(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *params, *updates, *slot_rows;
  int grad_enabled, bits;
  Py_ssize_t block;
  if (!PyArg_ParseTuple(args, "OOOpin", &params, &updates, &slot_rows, &grad_enabled, &bits, &block)) return nullptr;
  const Items ps(params), us(updates), rows(slot_rows);
  if (us.size() != ps.size() || rows.size() != ps.size() || (bits != 0 && block <= 0)) {
    PyErr_SetString(PyExc_ValueError, "one update and one row of slots per param, and a positive block");
    return nullptr;
  }
  const at::Device cpu(at::kCPU);
  THPObjectPtr codes(PyList_New(ps.size()));
  if (!codes) return nullptr;
  for (Py_ssize_t i = 0; i < ps.size(); ++i) {
    PyObject* p = ps[i];
    long long code = 0;
    const at::ScalarType dtype = plain(p) ? unpacked(p).scalar_type() : at::kByte;
    const long long kind = dtype == at::kFloat ? 1 : dtype == at::kDouble ? 2 : dtype == at::kBFloat16 ? 3 : 0;
    const Items slots(rows[i]);
    if (kind != 0 && us[i] != Py_None && unpacked(p).dim() != 0 && unpacked(p).is_cpu() && slots.size() <= 48) {
      const Py_ssize_t n = unpacked(p).numel();  // the lengths fadam.quantization._codec.expected_sizes gives
      const Py_ssize_t codes_length = bits == 0 ? -1 : (bits == 8 ? n : (n + 1) / 2);
      const Py_ssize_t scales = bits == 0 ? -1 : (n + block - 1) / block;
      bool ready = item_ready(p, 0, dtype, cpu, grad_enabled, codes_length, scales) &&
                   item_ready(us[i], 1, dtype, cpu, grad_enabled, codes_length, scales);
      long long quantized = 0;
      for (Py_ssize_t k = 0; ready && k < slots.size(); ++k) {
        ready = item_ready(slots[k], k + 2, dtype, cpu, grad_enabled, codes_length, scales);
        if (Py_TYPE(slots[k]) == quantized_type) quantized |= 1LL << k;
      }
      code = ready ? kind + 4 * quantized : 0;
    }
    PyObject* value = PyLong_FromLongLong(code);
    if (!value) return nullptr;
    PyList_SET_ITEM(codes.get(), i, value);
  }
  return codes.release();
  END_HANDLE_TH_ERRORS
}

// Prefetches ``count`` cache lines from ``at``
void prefetch_lines(const void* at, int count) {
  for (int line = 0; line < count; ++line) __builtin_prefetch(static_cast<const char*>(at) + 64 * line);
}

// Prefetches the objects of ``items`` from ``start`` on, then the TensorImpls of the plain tensors among them
// (distinct_storages says why)
void prefetch_tensors(const Items& items, Py_ssize_t start) {
  for (Py_ssize_t i = start; i < items.size(); ++i) __builtin_prefetch(items[i]);
  for (Py_ssize_t i = start; i < items.size(); ++i)
    if (plain(items[i])) prefetch_lines(unpacked(items[i]).unsafeGetTensorImpl(), 4);
}

// distinct_storages(trees): True where every leaf of ``trees`` (lists of leaves) is None, a plain strided tensor or
// a QuantizedArray of four such tensors, and no two of those tensors share a storage, so that
// fadam._dispatch.overlap_in_leaves finds no overlap among the tensors; None otherwise, where the caller looks in
// Python. Right after a kernel has swept the caches, each tensor's Python object, TensorImpl and StorageImpl are a
// cache miss apiece: they are read level by level, each level prefetched for every tensor first, so that the misses
// overlap instead of following one another.
PyObject* distinct_storages(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* trees;
  if (!PyArg_ParseTuple(args, "O", &trees)) return nullptr;
  const Items lists(trees);
  std::vector<PyObject*> leaves;
  for (Py_ssize_t k = 0; k < lists.size(); ++k) {
    const Items found(lists[k]);
    for (Py_ssize_t i = 0; i < found.size(); ++i) {
      if (found[i] == Py_None) continue;
      __builtin_prefetch(found[i]);
      leaves.push_back(found[i]);
    }
  }
  std::vector<PyObject*> tensors;
  tensors.reserve(leaves.size());
  for (PyObject* o : leaves) {
    if (Py_TYPE(o) != quantized_type) {
      tensors.push_back(o);
      continue;
    }
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(o); ++j) {
      __builtin_prefetch(PyTuple_GET_ITEM(o, j));
      tensors.push_back(PyTuple_GET_ITEM(o, j));
    }
  }
  std::vector<c10::TensorImpl*> impls;
  impls.reserve(tensors.size());
  for (PyObject* o : tensors) {
    if (!plain(o)) Py_RETURN_NONE;
    impls.push_back(unpacked(o).unsafeGetTensorImpl());
    prefetch_lines(impls.back(), 4);  // the fields read below lie in its first few lines
  }
  for (c10::TensorImpl* impl : impls) {
    if (impl->layout() != at::kStrided || !impl->has_storage()) Py_RETURN_NONE;
    __builtin_prefetch(impl->unsafe_storage().unsafeGetStorageImpl());
  }
  std::vector<const void*> pointers;
  pointers.reserve(impls.size());
  for (c10::TensorImpl* impl : impls) {
    const void* pointer = impl->unsafe_storage().data_ptr().get();
    if (pointer != nullptr) pointers.push_back(pointer);
  }
  std::sort(pointers.begin(), pointers.end());
  if (std::adjacent_find(pointers.begin(), pointers.end()) != pointers.end()) Py_RETURN_NONE;
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

// first_unlike(leaves, likes, start): the first index from ``start`` on where a leaf is not None and the pair is not
// two plain tensors that fadam._tree._dense_alike accepts; len(leaves) where there is none
PyObject* first_unlike(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *leaves, *likes;
  Py_ssize_t start;
  if (!PyArg_ParseTuple(args, "OOn", &leaves, &likes, &start)) return nullptr;
  const Items found(leaves);
  const Items refs(likes);
  if (refs.size() < found.size()) {
    PyErr_SetString(PyExc_ValueError, "fewer likes than leaves");
    return nullptr;
  }
  Py_ssize_t i = start < 0 ? 0 : start;
  prefetch_tensors(found, i);
  prefetch_tensors(refs, i);
  for (; i < found.size(); ++i) {
    PyObject* o = found[i];
    if (o == Py_None) continue;
    if (!plain(o) || !plain(refs[i])) break;
    const at::Tensor& leaf = unpacked(o);
    const at::Tensor& ref = unpacked(refs[i]);
    if (!(leaf.layout() == at::kStrided && is_optimizable(leaf) && is_optimizable(ref) &&
          leaf.sizes() == ref.sizes() && same_device(leaf, ref)))
      break;
  }
  return PyLong_FromSsize_t(i);
  END_HANDLE_TH_ERRORS
}

// same_places(slot_lists, references): True where each list holds, item by item, plain tensors (or quantized slots)
// of the shape and device of the plain tensor at that place of ``references`` (fadam._execute._same_place); None
// otherwise, where the caller compares in Python
PyObject* same_places(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *slot_lists, *references;
  if (!PyArg_ParseTuple(args, "OO", &slot_lists, &references)) return nullptr;
  const Items lists(slot_lists);
  const Items refs(references);
  for (Py_ssize_t k = 0; k < lists.size(); ++k) {
    const Items found(lists[k]);
    if (found.size() != refs.size()) Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < found.size(); ++i) {
      PyObject* slot = found[i];
      if (!plain(refs[i])) Py_RETURN_NONE;
      const at::Tensor& reference = unpacked(refs[i]);
      if (Py_TYPE(slot) == quantized_type && PyTuple_GET_SIZE(slot) == 4) {  // its codes' device, its like's shape
        PyObject* codes = PyTuple_GET_ITEM(slot, 0);
        PyObject* like = PyTuple_GET_ITEM(slot, 3);
        if (!plain(codes) || !plain(like)) Py_RETURN_NONE;
        const c10::IntArrayRef shape = unpacked(like).sizes();
        if (shape.empty() || shape.slice(0, shape.size() - 1) != reference.sizes() ||
            !same_device(unpacked(codes), reference))
          Py_RETURN_NONE;
        continue;
      }
      if (!plain(slot)) Py_RETURN_NONE;
      const at::Tensor& t = unpacked(slot);
      if (t.sizes() != reference.sizes() || !same_device(t, reference)) Py_RETURN_NONE;
    }
  }
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

// data_pointers(rows): the data pointers of the plain tensors of ``rows`` (lists), in turn, as native 64-bit
// integers in a bytes object (the table of leaf pointers a generated kernel takes)
PyObject* data_pointers(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* rows;
  if (!PyArg_ParseTuple(args, "O", &rows)) return nullptr;
  const Items lists(rows);
  std::vector<uint64_t> pointers;
  for (Py_ssize_t k = 0; k < lists.size(); ++k) {
    const Items found(lists[k]);
    for (Py_ssize_t i = 0; i < found.size(); ++i) {
      if (!plain(found[i])) {
        PyErr_SetString(PyExc_TypeError, "a kernel's leaves are plain tensors");
        return nullptr;
      }
      pointers.push_back(reinterpret_cast<uint64_t>(unpacked(found[i]).data_ptr()));
    }
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(pointers.data()),
                                   static_cast<Py_ssize_t>(pointers.size() * sizeof(uint64_t)));
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"setup", setup, METH_VARARGS, nullptr},
    {"placed", placed, METH_VARARGS, nullptr},
    {"leaf_ready", leaf_ready, METH_VARARGS, nullptr},
    {"rows_ready", rows_ready, METH_VARARGS, nullptr},
    {"distinct_storages", distinct_storages, METH_VARARGS, nullptr},
    {"first_unlike", first_unlike, METH_VARARGS, nullptr},
    {"same_places", same_places, METH_VARARGS, nullptr},
    {"data_pointers", data_pointers, METH_VARARGS, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "NAME", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_NAME() { return PyModule_Create(&module); }
""".replace("NAME", _NAME)


@functools.cache
def _flags() -> list[str]:
    # torch's wheel holds its headers and libraries beside its package (torch.utils.cpp_extension's include_paths and
    # library_paths, whose import would add 0.15 s to the first step)
    installed = Path(torch.__file__).parent
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-I{installed / 'include'}", f"-I{sysconfig.get_paths()['include']}"]
    libraries = [f"-L{installed / 'lib'}", f"-Wl,-rpath,{installed / 'lib'}"]
    # a Python extension leaves Python's own symbols to the interpreter that loads it
    unresolved = ["-undefined", "dynamic_lookup"] if platform.system() == "Darwin" else []
    return [
        "-O2",
        "-shared",
        "-fPIC",
        "-std=c++17",
        "-w",  # torch's headers warn under C++17
        abi,
        *includes,
        *libraries,
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_python",
        *unresolved,
    ]


@functools.cache
def _library_path() -> Path | None:
    """Where this machine's build lives, named by everything it depends on; ``None`` without a compiler."""
    from fadam._cpu_kernel import _compiler, cache_dir

    compiler = _compiler()
    if compiler is None:
        return None
    described = "\0".join(
        [_SOURCE, *compiler, " ".join(_flags()), torch.__version__, str(torch.version.git_version), sys.version]
    )
    key = hashlib.sha256(described.encode()).hexdigest()[:24]
    return cache_dir() / "checks" / f"{key}{importlib.machinery.EXTENSION_SUFFIXES[0]}"


# The build runs in a process of its own, which outlives the one that starts it. It compiles into a scratch folder and
# renames the library into place (atomically: a process loading it sees the whole library or none), one build at a
# time on a machine: every worker of a test run starts one, the later ones find the library built when the lock is
# theirs.
_BUILDER = """
import os, shutil, subprocess, sys
scratch, target, failure, command = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
# the compiler takes only CPU time that nothing else wants: a nice level alone still delays the wake-up of torch's
# threads at each parallel region (which made a first Adafactor step on 2 cores take 6 s instead of 0.2)
if hasattr(os, "sched_setscheduler"):
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
elif hasattr(os, "nice"):
    os.nice(19)
try:
    import fcntl
except ImportError:
    fcntl = None
with open(os.path.join(os.path.dirname(target), "." + os.path.basename(target) + ".lock"), "w") as lock:
    if fcntl is not None:
        fcntl.flock(lock, fcntl.LOCK_EX)
    result = None if os.path.exists(target) else subprocess.run(command, capture_output=True)
    built = result is None or result.returncode == 0
    if built and not os.path.exists(target):
        os.replace(os.path.join(scratch, "checks.so"), target)
    if not built:  # what the compiler said, where no later process tries again
        with open(failure, "wb") as note:
            note.write(result.stderr[-4000:])
shutil.rmtree(scratch, ignore_errors=True)
sys.exit(0 if built else 1)
"""


def _failure_note(target: Path) -> Path:
    """Where a failed build of ``target`` leaves the compiler's message (and so that no process builds it again)."""
    return target.with_name(target.name + ".failed")


def start_build(target: Path) -> subprocess.Popen | None:
    """Starts building the extension into ``target`` in a process of its own; ``None`` without a compiler."""
    from fadam._cpu_kernel import _compiler

    compiler = _compiler()
    if compiler is None:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    source = scratch / "checks.cpp"
    source.write_text(_SOURCE)
    command = [compiler[0], str(source), "-o", str(scratch / "checks.so"), *_flags()]
    return subprocess.Popen(
        [sys.executable, "-c", _BUILDER, str(scratch), str(target), str(_failure_note(target)), *command],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not stopped with its parent's process group (a Ctrl-C of the training script)
    )


def build(target: Path) -> bool:
    """Builds the extension into ``target`` and waits; whether it is there."""
    builder = start_build(target)
    return builder is not None and builder.wait() == 0 and target.exists()


def _load(path: Path) -> ModuleType | None:
    try:
        spec = importlib.util.spec_from_file_location(_NAME, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError):
        return None
    from fadam.quantization._codec import QuantizedArray

    module.setup(torch.Tensor, torch.nn.Parameter, QuantizedArray, tuple(_optimizable()))
    return module


def _optimizable() -> frozenset[torch.dtype]:
    from fadam._tree import _OPTIMIZABLE

    return _OPTIMIZABLE


class _Loader:
    """The extension once it is loaded. A process that finds no build starts one when it exits (``atexit``), so that
    none of its steps shares the CPU with the compiler (even at idle priority a compile beside it made a first run of
    the README's demo on 2 cores take 17 s instead of 3): the processes after it load the library."""

    def __init__(self) -> None:
        self.module: ModuleType | None = None
        self.given_up = False  # no compiler, or a build failed: the checks stay in Python
        self.path: Path | None = None  # where the library is, or will be
        self.next_look = 0.0  # when to look again for a library another process may be building
        self.lock = threading.Lock()

    def get(self) -> ModuleType | None:
        if self.module is not None or self.given_up or time.monotonic() < self.next_look:
            return self.module
        with self.lock:
            if self.module is not None or self.given_up:
                return self.module
            if self.path is None:
                self.path = _library_path()
                if self.path is not None and not self.path.exists():
                    atexit.register(self.build_at_exit)
            if self.path is None or _failure_note(self.path).exists():
                self.given_up = True
            elif self.path.exists():
                self.module = _load(self.path)
                self.given_up = self.module is None
            else:
                self.next_look = time.monotonic() + 1.0
        return self.module

    def build_at_exit(self) -> subprocess.Popen | None:
        """Starts the build (``start_build``) unless the library is there by now; the process it starts outlives
        this one."""
        if self.path is None or self.path.exists() or _failure_note(self.path).exists():
            return None
        try:
            return start_build(self.path)
        except OSError:
            return None


_loader = _Loader()


def compiled_checks() -> ModuleType | None:
    """The loaded extension, or ``None``: while torch.compile traces (dynamo cannot trace an extension's functions)
    or a ``torch.func`` transform runs (its wrapped tensors are checked in Python), in a process that found it not
    built (it starts the build as it exits) and where it cannot be built."""
    if torch.compiler.is_compiling() or _current_level() is not None:
        return None
    return _loader.module if _loader.module is not None else _loader.get()
