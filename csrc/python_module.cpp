// Makes `import hetcomm._C` load the library (which registers the ops) and carries
// the facts of the build that hetcomm.info() reports. No bindings live here: the
// ops are reached through torch.ops.hetcomm.
#include <Python.h>

#include "cpu/multi_tensor_cpu.h"

#include <c10/util/Exception.h>

#ifndef HETCOMM_TORCH_VERSION
#define HETCOMM_TORCH_VERSION "unknown"
#endif
#ifndef HETCOMM_CUDA_ARCHS
#define HETCOMM_CUDA_ARCHS ""
#endif
#ifndef HETCOMM_CUDA_VERSION
#define HETCOMM_CUDA_VERSION ""
#endif

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  const char* cpu_isa = nullptr;
  try {
    cpu_isa = hetcomm::cpu::vector_isa();  // also validates HETCOMM_CPU_ISA at import
  } catch (const c10::Error& error) {
    PyErr_SetString(PyExc_ImportError, error.what_without_backtrace());
    return nullptr;
  }
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) {
    return nullptr;
  }
  if (PyModule_AddStringConstant(m, "built_with_torch", HETCOMM_TORCH_VERSION) < 0 ||
      PyModule_AddStringConstant(m, "cuda_archs", HETCOMM_CUDA_ARCHS) < 0 ||
      PyModule_AddStringConstant(m, "cuda_version", HETCOMM_CUDA_VERSION) < 0 ||
      PyModule_AddStringConstant(m, "cpu_isa", cpu_isa) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
