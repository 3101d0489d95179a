/* kvruntime's reader of block-id lists: a list of plain ints into an int64 buffer in one pass,
 * with what a plan needs to know of it on the way (lowest, highest, consecutive or not).
 *
 * Engines pass block ids as Python lists. Reading 4096 of them through array('q') or numpy
 * costs 75-150 us on a cloud VM's CPU (an int's type is looked up, then its value parsed, per
 * item), as much as copying a GiB between two buffers on an H100 takes a fifth of. Here an item
 * costs a type check and a read of its digits.
 *
 * Built and loaded by native.py, which falls back to array('q') where no C compiler or no Python
 * headers are found: this file only makes the same reading faster, it never decides anything.
 * Anything but a plain int (bool, float, an int subclass, numpy scalars), or an int outside
 * int64, makes scan() answer None and the caller reads the list its general way, which names
 * what is wrong. No Python code runs inside the loop, so the list cannot change under it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* An exact int's value into *v; 0 when it lies outside long long. Small ints (one digit, i.e.
 * below 2**30 in magnitude: every block id) are read inline where this Python's headers allow. */
static inline int read_int(PyObject *item, long long *v)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        *v = (long long)PyUnstable_Long_CompactValue((PyLongObject *)item);
        return 1;
    }
#elif PY_VERSION_HEX >= 0x030B0000
    Py_ssize_t size = Py_SIZE(item);
    if (size >= -1 && size <= 1) {
        *v = size * (long long)((PyLongObject *)item)->ob_digit[0];
        return 1;
    }
#endif
    int overflow = 0;
    *v = PyLong_AsLongLongAndOverflow(item, &overflow);
    return !overflow;
}

/* scan(ids: list, out: writable C-contiguous buffer of 8-byte items, at least len(ids) of them)
 *   -> (lowest, highest, consecutive) for a non-empty list of plain ints within int64,
 *      consecutive meaning ids[i] == ids[0] + i for every i;
 *   -> None for anything else (out may then hold part of the list). */
static PyObject *scan(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "scan(ids, out) takes two arguments");
        return NULL;
    }
    PyObject *list = args[0];
    if (!PyList_CheckExact(list) || PyList_GET_SIZE(list) == 0)
        Py_RETURN_NONE;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (view.itemsize != 8 || view.len < n * 8) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "scan: out must hold len(ids) 8-byte items");
        return NULL;
    }
    int64_t *out = (int64_t *)view.buf;
    int64_t lo = 0, hi = 0, prev = 0;
    int consecutive = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        long long v;
        if (!PyLong_CheckExact(item) || !read_int(item, &v))
            goto general;
        out[i] = (int64_t)v;
        if (i == 0) {
            lo = hi = (int64_t)v;
        } else {
            if (v < lo) lo = v;
            if (v > hi) hi = v;
            consecutive &= prev != INT64_MAX && v == prev + 1;
        }
        prev = (int64_t)v;
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(LLO)", (long long)lo, (long long)hi,
                         consecutive ? Py_True : Py_False);
general:
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL,
     "scan(ids, out) -> (lowest, highest, consecutive) or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_kvr_idscan", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__kvr_idscan(void) { return PyModule_Create(&module); }
