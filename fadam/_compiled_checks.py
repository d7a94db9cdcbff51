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
there starts one, in a process of its own (about 10-15 s on a 2-core machine), and checks in Python until it is
ready, so the first steps never wait for it; without a compiler or Python's headers the checks stay in Python.
"""

from __future__ import annotations

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
from pathlib import Path
from types import ModuleType

import torch
from torch._C._functorch import maybe_current_level as _current_level

_NAME = "_fadam_checks"

_SOURCE = r"""
#include <Python.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <unordered_set>

namespace {

PyTypeObject* tensor_type = nullptr;     // torch.Tensor
PyTypeObject* parameter_type = nullptr;  // torch.nn.Parameter
bool optimizable[256] = {};              // fadam._tree._OPTIMIZABLE, by at::ScalarType

bool plain(PyObject* o) { return Py_TYPE(o) == tensor_type || Py_TYPE(o) == parameter_type; }

// the items of a list or tuple, or null with a TypeError
PyObject* items(PyObject* sequence) { return PySequence_Fast(sequence, "expected a list or a tuple"); }

// setup(torch.Tensor, torch.nn.Parameter, optimizable dtypes)
PyObject* setup(PyObject*, PyObject* args) {
  PyObject *tensor, *parameter, *dtypes;
  if (!PyArg_ParseTuple(args, "O!O!O", &PyType_Type, &tensor, &PyType_Type, &parameter, &dtypes)) return nullptr;
  PyObject* found = items(dtypes);
  if (!found) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(found); ++i) {
    PyObject* dtype = PySequence_Fast_GET_ITEM(found, i);
    if (!THPDtype_Check(dtype)) {
      Py_DECREF(found);
      PyErr_SetString(PyExc_TypeError, "expected torch.dtype objects");
      return nullptr;
    }
    optimizable[static_cast<int>(reinterpret_cast<THPDtype*>(dtype)->scalar_type) & 255] = true;
  }
  Py_DECREF(found);
  Py_INCREF(tensor);
  Py_INCREF(parameter);
  tensor_type = reinterpret_cast<PyTypeObject*>(tensor);
  parameter_type = reinterpret_cast<PyTypeObject*>(parameter);
  Py_RETURN_NONE;
}

// placed(tensors, dtype, device, grad_enabled): fadam._execute._placed outside torch.func transforms: whether every
// item is a plain dense contiguous tensor of ``dtype`` on ``device`` that autograd does not record
PyObject* placed(PyObject*, PyObject* args) {
  PyObject *tensors, *dtype, *device;
  int grad_enabled;
  if (!PyArg_ParseTuple(args, "OO!O!p", &tensors, &THPDtypeType, &dtype, &THPDeviceType, &device, &grad_enabled))
    return nullptr;
  const at::ScalarType scalar_type = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
  const at::Device& where = reinterpret_cast<THPDevice*>(device)->device;
  PyObject* found = items(tensors);
  if (!found) return nullptr;
  bool answer = true;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(found) && answer; ++i) {
    PyObject* o = PySequence_Fast_GET_ITEM(found, i);
    if (!plain(o)) {
      answer = false;
      break;
    }
    const at::Tensor& t = THPVariable_Unpack(o);
    answer = t.layout() == at::kStrided && !(grad_enabled && t.requires_grad()) && t.is_contiguous() &&
             t.scalar_type() == scalar_type && (where.is_cpu() ? t.is_cpu() : t.device() == where);
  }
  Py_DECREF(found);
  return PyBool_FromLong(answer);
}

// distinct_storages(trees): True where every leaf of ``trees`` (lists of leaves) is None or a plain strided tensor
// and no two of those share a storage, so that fadam._dispatch.overlap_in_leaves finds no overlap; None otherwise,
// where the caller looks in Python
PyObject* distinct_storages(PyObject*, PyObject* args) {
  PyObject* trees;
  if (!PyArg_ParseTuple(args, "O", &trees)) return nullptr;
  PyObject* lists = items(trees);
  if (!lists) return nullptr;
  std::unordered_set<const void*> seen;
  bool distinct = true;
  for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(lists) && distinct; ++k) {
    PyObject* found = items(PySequence_Fast_GET_ITEM(lists, k));
    if (!found) {
      Py_DECREF(lists);
      return nullptr;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(found) && distinct; ++i) {
      PyObject* o = PySequence_Fast_GET_ITEM(found, i);
      if (o == Py_None) continue;
      if (!plain(o)) {
        distinct = false;
        break;
      }
      const at::Tensor& t = THPVariable_Unpack(o);
      if (t.layout() != at::kStrided || !t.has_storage()) {
        distinct = false;
        break;
      }
      const void* pointer = t.storage().data_ptr().get();
      if (pointer != nullptr) distinct = seen.insert(pointer).second;
    }
    Py_DECREF(found);
  }
  Py_DECREF(lists);
  if (!distinct) Py_RETURN_NONE;
  Py_RETURN_TRUE;
}

// first_unlike(leaves, likes, start): the first index from ``start`` on where a leaf is not None and the pair is not
// two plain tensors that fadam._tree._dense_alike accepts; len(leaves) where there is none
PyObject* first_unlike(PyObject*, PyObject* args) {
  PyObject *leaves, *likes;
  Py_ssize_t start;
  if (!PyArg_ParseTuple(args, "OOn", &leaves, &likes, &start)) return nullptr;
  PyObject* found = items(leaves);
  if (!found) return nullptr;
  PyObject* refs = items(likes);
  if (!refs) {
    Py_DECREF(found);
    return nullptr;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(found);
  if (PySequence_Fast_GET_SIZE(refs) < n) {
    Py_DECREF(found);
    Py_DECREF(refs);
    PyErr_SetString(PyExc_ValueError, "fewer likes than leaves");
    return nullptr;
  }
  Py_ssize_t i = start < 0 ? 0 : start;
  for (; i < n; ++i) {
    PyObject* o = PySequence_Fast_GET_ITEM(found, i);
    if (o == Py_None) continue;
    PyObject* r = PySequence_Fast_GET_ITEM(refs, i);
    if (!plain(o) || !plain(r)) break;
    const at::Tensor& leaf = THPVariable_Unpack(o);
    const at::Tensor& ref = THPVariable_Unpack(r);
    if (!(leaf.layout() == at::kStrided && optimizable[static_cast<int>(leaf.scalar_type()) & 255] &&
          optimizable[static_cast<int>(ref.scalar_type()) & 255] && leaf.sizes() == ref.sizes() &&
          ((leaf.is_cpu() && ref.is_cpu()) || leaf.device() == ref.device())))
      break;
  }
  Py_DECREF(found);
  Py_DECREF(refs);
  return PyLong_FromSsize_t(i);
}

// same_places(slot_lists, references): True where each list holds, item by item, plain tensors of the shape and
// device of the plain tensor at that place of ``references`` (fadam._execute._same_place's common case); None
// otherwise, where the caller compares in Python
PyObject* same_places(PyObject*, PyObject* args) {
  PyObject *slot_lists, *references;
  if (!PyArg_ParseTuple(args, "OO", &slot_lists, &references)) return nullptr;
  PyObject* lists = items(slot_lists);
  if (!lists) return nullptr;
  PyObject* refs = items(references);
  if (!refs) {
    Py_DECREF(lists);
    return nullptr;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(refs);
  bool same = true;
  for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(lists) && same; ++k) {
    PyObject* found = items(PySequence_Fast_GET_ITEM(lists, k));
    if (!found) {
      Py_DECREF(lists);
      Py_DECREF(refs);
      return nullptr;
    }
    same = PySequence_Fast_GET_SIZE(found) == n;
    for (Py_ssize_t i = 0; i < n && same; ++i) {
      PyObject* slot = PySequence_Fast_GET_ITEM(found, i);
      PyObject* reference = PySequence_Fast_GET_ITEM(refs, i);
      if (!plain(slot) || !plain(reference)) {
        same = false;
        break;
      }
      const at::Tensor& s = THPVariable_Unpack(slot);
      const at::Tensor& r = THPVariable_Unpack(reference);
      same = s.sizes() == r.sizes() && ((s.is_cpu() && r.is_cpu()) || s.device() == r.device());
    }
    Py_DECREF(found);
  }
  Py_DECREF(lists);
  Py_DECREF(refs);
  if (!same) Py_RETURN_NONE;
  Py_RETURN_TRUE;
}

PyMethodDef methods[] = {
    {"setup", setup, METH_VARARGS, nullptr},
    {"placed", placed, METH_VARARGS, nullptr},
    {"distinct_storages", distinct_storages, METH_VARARGS, nullptr},
    {"first_unlike", first_unlike, METH_VARARGS, nullptr},
    {"same_places", same_places, METH_VARARGS, nullptr},
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


# The build runs in a process of its own, which outlives the one that starts it (a short script's exit would end a
# thread's compiler before it renames the library into place). It compiles into a scratch folder and renames the
# library into place (atomically: a process loading it sees the whole library or none), one build at a time on a
# machine: every worker of a test run starts one, the later ones find the library built when the lock is theirs.
_BUILDER = """
import os, shutil, subprocess, sys
scratch, target, command = sys.argv[1], sys.argv[2], sys.argv[3:]
try:
    import fcntl
except ImportError:
    fcntl = None
with open(os.path.join(os.path.dirname(target), "." + os.path.basename(target) + ".lock"), "w") as lock:
    if fcntl is not None:
        fcntl.flock(lock, fcntl.LOCK_EX)
    built = os.path.exists(target) or subprocess.run(command, capture_output=True).returncode == 0
    if built and not os.path.exists(target):
        os.replace(os.path.join(scratch, "checks.so"), target)
shutil.rmtree(scratch, ignore_errors=True)
sys.exit(0 if built else 1)
"""


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
        [sys.executable, "-c", _BUILDER, str(scratch), str(target), *command],
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
    module.setup(torch.Tensor, torch.nn.Parameter, tuple(_optimizable()))
    return module


def _optimizable() -> frozenset[torch.dtype]:
    from fadam._tree import _OPTIMIZABLE

    return _OPTIMIZABLE


class _Loader:
    """The extension once it is loaded; until then, at most one build started by this process."""

    def __init__(self) -> None:
        self.module: ModuleType | None = None
        self.given_up = False  # no compiler, or the build failed: the checks stay in Python
        self.builder: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def get(self) -> ModuleType | None:
        if self.module is not None or self.given_up:
            return self.module
        with self.lock:
            if self.module is not None or self.given_up or (self.builder is not None and self.builder.poll() is None):
                return self.module
            path = _library_path()
            if path is None:
                self.given_up = True
            elif path.exists():
                self.module = _load(path)
                self.given_up = self.module is None
            elif self.builder is not None:  # it ended without a library
                self.given_up = True
            else:
                try:
                    self.builder = start_build(path)
                except OSError:
                    self.builder = None
                self.given_up = self.builder is None
        return self.module


_loader = _Loader()


def compiled_checks() -> ModuleType | None:
    """The loaded extension, or ``None``: while torch.compile traces (dynamo cannot trace an extension's functions)
    or a ``torch.func`` transform runs (its wrapped tensors are checked in Python), while the extension builds (the
    first call starts the build) and where it cannot be built."""
    if torch.compiler.is_compiling() or _current_level() is not None:
        return None
    return _loader.module if _loader.module is not None else _loader.get()
