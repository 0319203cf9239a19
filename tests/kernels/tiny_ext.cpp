// A minimal Python extension module (no torch) for the build tests: builds in a fraction of a
// second, so the tests can build, kill, corrupt and rebuild it.
#include <Python.h>
#define KV_CAT2(a, b) a##b
#define KV_CAT(a, b) KV_CAT2(a, b)
#define KV_STR2(a) #a
#define KV_STR(a) KV_STR2(a)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef def = {PyModuleDef_HEAD_INIT, KV_STR(KVSERVE_MODULE), nullptr, -1, methods};
PyMODINIT_FUNC KV_CAT(PyInit_, KVSERVE_MODULE)(void) { return PyModule_Create(&def); }
