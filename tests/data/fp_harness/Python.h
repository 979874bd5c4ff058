/* Just enough of Python.h to compile unickpt/spec/_fp2kernel.c into a plain C harness (no Python:
 * the loops are tested on a CPU emulator, tests/unit/test_fp_kernel_levels.py). */
#include <stddef.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
typedef long Py_ssize_t;
typedef struct _object PyObject;
typedef struct { void *buf; Py_ssize_t len; } Py_buffer;
typedef PyObject *(*PyCFunction)(PyObject *, PyObject *);
typedef struct { const char *n; PyCFunction f; int flags; const char *doc; } PyMethodDef;
typedef struct PyModuleDef { int head; const char *name; const char *doc; Py_ssize_t size; PyMethodDef *m; } PyModuleDef;
#define PyModuleDef_HEAD_INIT 0
#define METH_VARARGS 1
#define METH_NOARGS 4
#define PyMODINIT_FUNC PyObject *
#define Py_BEGIN_ALLOW_THREADS {
#define Py_END_ALLOW_THREADS }
static PyObject *PyExc_ValueError;
static PyObject * PySequence_Fast(PyObject * a0, const char * a1) { return 0; }
static Py_ssize_t PySequence_Fast_GET_SIZE(PyObject * a0) { return 0; }
static PyObject * PySequence_Fast_GET_ITEM(PyObject * a0, Py_ssize_t a1) { return 0; }
static long long PyLong_AsLongLong(PyObject * a0) { return 0; }
static PyObject * PyErr_Occurred(void) { return 0; }
static void Py_DECREF(PyObject * a0) {  }
static PyObject * PyErr_Format(PyObject * a0, const char * a1, ...) { return 0; }
static void PyErr_SetString(PyObject * a0, const char * a1) {  }
static int PyArg_ParseTuple(PyObject * a0, const char * a1, ...) { return 0; }
static PyObject * Py_BuildValue(const char * a0, ...) { return 0; }
static void PyBuffer_Release(Py_buffer * a0) {  }
static PyObject * PyUnicode_FromString(const char * a0) { return 0; }
static PyObject * PyModule_Create(PyModuleDef * a0) { return 0; }
