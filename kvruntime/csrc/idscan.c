/* kvruntime's reader of block-id lists: a list of plain ints into an int64 buffer in one pass,
 * with what a plan needs to know of it on the way (lowest, highest, consecutive or not); and
 * a batch's lists read in one call; and the split of a batch's ids into runs, its range and
 * duplicate checks made on the way.
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
#include <string.h>

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

/* Plain ints within int64 of `list` into out[0..len-1]; 0 at the first that is not one. */
static int read_list(PyObject *list, int64_t *out)
{
    Py_ssize_t n = PyList_GET_SIZE(list);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        long long v;
        if (!PyLong_CheckExact(item) || !read_int(item, &v))
            return 0;
        out[i] = (int64_t)v;
    }
    return 1;
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
    if (!read_list(list, out)) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    int64_t lo = out[0], hi = out[0];
    int consecutive = 1;
    for (Py_ssize_t i = 1; i < n; i++) { /* over the int64s: a pass of plain C */
        int64_t v = out[i];
        if (v < lo) lo = v;
        if (v > hi) hi = v;
        consecutive &= out[i - 1] != INT64_MAX && v == out[i - 1] + 1;
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(LLO)", (long long)lo, (long long)hi,
                         consecutive ? Py_True : Py_False);
}

/* A request's lists, or 0: (ids, ids or None) as a 2-tuple or 2-list, the ids a non-empty list,
 * the second as long as the first. */
static int request_lists(PyObject *request, PyObject **src, PyObject **dst)
{
    if (PyTuple_CheckExact(request) && PyTuple_GET_SIZE(request) == 2) {
        *src = PyTuple_GET_ITEM(request, 0);
        *dst = PyTuple_GET_ITEM(request, 1);
    } else if (PyList_CheckExact(request) && PyList_GET_SIZE(request) == 2) {
        *src = PyList_GET_ITEM(request, 0);
        *dst = PyList_GET_ITEM(request, 1);
    } else {
        return 0;
    }
    if (!PyList_CheckExact(*src) || PyList_GET_SIZE(*src) == 0)
        return 0;
    if (*dst == Py_None)
        return 1;
    return PyList_CheckExact(*dst) && PyList_GET_SIZE(*dst) == PyList_GET_SIZE(*src);
}

/* scan_batch(requests: list of (ids, ids or None), bounds: writable k+1 int64) -> bytearray or None
 *   A batch of k requests (an engine step's pulls) read in one call, not one scan() each: the
 *   bytearray holds 2 x n int64, the source ids then the destination ids (a request without
 *   destinations gets its sources), and bounds[j]..bounds[j+1]-1 are request j's pairs.
 *   None unless every request is a 2-tuple (or 2-list) of non-empty lists of plain ints within
 *   int64, the destinations None or as long as the sources: the caller reads such a batch its
 *   general way, which names what is wrong. Ranges and duplicates are runs()' checks. */
static PyObject *scan_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "scan_batch(requests, bounds) takes two arguments");
        return NULL;
    }
    PyObject *batch = args[0];
    if (!PyList_CheckExact(batch) || PyList_GET_SIZE(batch) == 0)
        Py_RETURN_NONE;
    Py_ssize_t k = PyList_GET_SIZE(batch);
    Py_buffer vb;
    if (PyObject_GetBuffer(args[1], &vb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (vb.itemsize != 8 || vb.len < (k + 1) * 8) {
        PyBuffer_Release(&vb);
        PyErr_SetString(PyExc_ValueError, "scan_batch: bounds must hold len(requests)+1 int64");
        return NULL;
    }
    int64_t *bounds = (int64_t *)vb.buf;
    PyObject *src, *dst, *raw = NULL;
    Py_ssize_t n = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        if (!request_lists(PyList_GET_ITEM(batch, j), &src, &dst))
            goto general;
        bounds[j] = n;
        n += PyList_GET_SIZE(src);
        if (n > PY_SSIZE_T_MAX / 16) /* 2 x n items of 8 bytes must fit */
            goto general;
    }
    bounds[k] = n;
    raw = PyByteArray_FromStringAndSize(NULL, 16 * n);
    if (raw == NULL) {
        PyBuffer_Release(&vb);
        return NULL;
    }
    int64_t *out_src = (int64_t *)PyByteArray_AS_STRING(raw), *out_dst = out_src + n;
    /* no Python code runs below (exact lists of exact ints): nothing read can change under it */
    for (Py_ssize_t j = 0; j < k; j++) {
        request_lists(PyList_GET_ITEM(batch, j), &src, &dst);
        int64_t at = bounds[j];
        if (!read_list(src, out_src + at))
            goto general;
        if (dst == Py_None)
            memcpy(out_dst + at, out_src + at, (size_t)(bounds[j + 1] - at) * 8);
        else if (!read_list(dst, out_dst + at))
            goto general;
    }
    PyBuffer_Release(&vb);
    return raw;
general:
    Py_XDECREF(raw);
    PyBuffer_Release(&vb);
    Py_RETURN_NONE;
}

/* A writable (or read-only) C-contiguous buffer of at least `items` items of `itemsize` bytes. */
static int get_buffer(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize,
                      Py_ssize_t items, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->itemsize != itemsize || view->len < items * itemsize) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "runs: %s must hold %zd items of %zd bytes", what, items,
                     itemsize);
        return -1;
    }
    return 0;
}

/* runs(ids, bounds, seen, src_blocks, dst_blocks, out, run_bounds) -> count of runs, 0 or -1
 *
 *   ids: 2 x n int64 (source ids, then destination ids) of a batch of requests, request k
 *        holding pairs bounds[k]..bounds[k+1]-1 (bounds: k+1 int64, 0 first, n last);
 *   seen: src_blocks + dst_blocks bytes, all zero (they are zero again on return, whatever it
 *        returns: a planner keeps one and never clears it);
 *   out: 3 x n int64, written with each run's source start, destination start and block count
 *        in rows 0, 1 and 2; run_bounds: k+1 int64, request k's runs being run_bounds[k]..
 *        run_bounds[k+1]-1.
 * A run is a stretch of pairs within one request where both ids grow by one. Returns the count
 * of runs; 0 when a source id appears twice in one request or a destination id twice in the
 * batch; -1 when an id lies outside 0..src_blocks-1 (source) or 0..dst_blocks-1 (destination).
 * The caller words the refusal (plan.py). The GIL is held throughout, so threads sharing a
 * planner's seen buffer take turns. */
static PyObject *runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "runs(ids, bounds, seen, src_blocks, dst_blocks, out, run_bounds)");
        return NULL;
    }
    Py_ssize_t ns = PyLong_AsSsize_t(args[3]), nd = PyLong_AsSsize_t(args[4]);
    if ((ns == -1 || nd == -1) && PyErr_Occurred())
        return NULL;
    if (ns < 1 || nd < 1 || ns > PY_SSIZE_T_MAX - nd) {
        PyErr_SetString(PyExc_ValueError, "runs: block counts must be positive (and fit memory)");
        return NULL;
    }
    Py_buffer vb, vi, vs, vo, vr;
    if (PyObject_GetBuffer(args[1], &vb, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    Py_ssize_t k = vb.len / 8 - 1;
    const int64_t *bounds = (const int64_t *)vb.buf;
    if (vb.itemsize != 8 || k < 1 || bounds[0] != 0) {
        PyBuffer_Release(&vb);
        PyErr_SetString(PyExc_ValueError, "runs: bounds must be k+1 int64, 0 first");
        return NULL;
    }
    if (bounds[k] > (int64_t)(PY_SSIZE_T_MAX / 24)) { /* 3 x n items of 8 bytes must fit */
        PyBuffer_Release(&vb);
        PyErr_SetString(PyExc_ValueError, "runs: more pairs than memory can hold");
        return NULL;
    }
    Py_ssize_t n = (Py_ssize_t)bounds[k];
    for (Py_ssize_t j = 0; j < k; j++) {
        if (bounds[j + 1] < bounds[j]) {
            PyBuffer_Release(&vb);
            PyErr_SetString(PyExc_ValueError, "runs: bounds must not decrease");
            return NULL;
        }
    }
    if (get_buffer(args[0], &vi, 0, 8, 2 * n, "ids") < 0) {
        PyBuffer_Release(&vb);
        return NULL;
    }
    if (get_buffer(args[2], &vs, 1, 1, ns + nd, "seen") < 0) {
        PyBuffer_Release(&vb);
        PyBuffer_Release(&vi);
        return NULL;
    }
    if (get_buffer(args[5], &vo, 1, 8, 3 * n, "out") < 0) {
        PyBuffer_Release(&vb);
        PyBuffer_Release(&vi);
        PyBuffer_Release(&vs);
        return NULL;
    }
    if (get_buffer(args[6], &vr, 1, 8, k + 1, "run_bounds") < 0) {
        PyBuffer_Release(&vb);
        PyBuffer_Release(&vi);
        PyBuffer_Release(&vs);
        PyBuffer_Release(&vo);
        return NULL;
    }
    const int64_t *src = (const int64_t *)vi.buf, *dst = src + n;
    uint8_t *seen_src = (uint8_t *)vs.buf, *seen_dst = seen_src + ns;
    int64_t *run_src = (int64_t *)vo.buf, *run_dst = run_src + n, *run_count = run_dst + n;
    int64_t *run_bounds = (int64_t *)vr.buf;
    Py_ssize_t r = 0, i = 0, first = 0; /* first: the current request's first pair */
    long result = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        first = (Py_ssize_t)bounds[j];
        Py_ssize_t end = (Py_ssize_t)bounds[j + 1];
        run_bounds[j] = r;
        for (i = first; i < end; i++) {
            int64_t s = src[i], d = dst[i];
            if (s < 0 || s >= ns || d < 0 || d >= nd) {
                result = -1;
                goto undo;
            }
            if (seen_src[s] | seen_dst[d])
                goto undo; /* result 0 */
            seen_src[s] = 1;
            seen_dst[d] = 1;
            if (i > first && s == src[i - 1] + 1 && d == dst[i - 1] + 1) {
                run_count[r - 1]++;
            } else {
                run_src[r] = s;
                run_dst[r] = d;
                run_count[r] = 1;
                r++;
            }
        }
        for (i = first; i < end; i++) /* a block may be read by two requests */
            seen_src[src[i]] = 0;
    }
    run_bounds[k] = r;
    for (i = 0; i < n; i++)
        seen_dst[dst[i]] = 0;
    result = (long)r;
    goto done;
undo: /* pairs first..i-1 marked their source, 0..i-1 their destination: all in range */
    for (Py_ssize_t m = first; m < i; m++)
        seen_src[src[m]] = 0;
    for (Py_ssize_t m = 0; m < i; m++)
        seen_dst[dst[m]] = 0;
done:
    PyBuffer_Release(&vb);
    PyBuffer_Release(&vi);
    PyBuffer_Release(&vs);
    PyBuffer_Release(&vo);
    PyBuffer_Release(&vr);
    return PyLong_FromLong(result);
}

/* copy(dst, src, length) -> None
 *
 *   dst, src: either an int (the address of a contiguous range: piece i at address + i *
 *   length) or a C-contiguous buffer of n uint64 addresses (piece i at address[i]); at least
 *   one of them is a buffer, and two buffers hold the same count.
 * Copies n pieces of `length` bytes each: the gather of a request's blocks into a staging run
 * (src the cache's addresses, dst the run) and the scatter back (the other way round). The
 * addresses are kvruntime's own (staging.py computes them from its layouts and checked ids),
 * never a peer's. The GIL is released for the copies: a scatter on one thread runs beside the
 * NIXL calls of another. */
static PyObject *copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy takes 3 arguments");
        return NULL;
    }
    Py_ssize_t length = PyLong_AsSsize_t(args[2]);
    if (length < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "copy: negative length");
        return NULL;
    }
    Py_buffer vd = {0}, vs = {0};
    int dbuf = !PyLong_Check(args[0]), sbuf = !PyLong_Check(args[1]);
    uintptr_t dbase = 0, sbase = 0;
    Py_ssize_t n = -1;
    if (!dbuf && !sbuf) {
        PyErr_SetString(PyExc_ValueError, "copy: one side must be a buffer of addresses");
        return NULL;
    }
    if (dbuf) {
        if (PyObject_GetBuffer(args[0], &vd, PyBUF_C_CONTIGUOUS) < 0)
            return NULL;
        n = vd.len / 8;
    } else {
        dbase = (uintptr_t)PyLong_AsUnsignedLongLong(args[0]);
    }
    if (sbuf) {
        if (PyObject_GetBuffer(args[1], &vs, PyBUF_C_CONTIGUOUS) < 0) {
            if (dbuf)
                PyBuffer_Release(&vd);
            return NULL;
        }
        if (n >= 0 && vs.len / 8 != n) {
            PyBuffer_Release(&vs);
            PyBuffer_Release(&vd);
            PyErr_SetString(PyExc_ValueError, "copy: address lists of different lengths");
            return NULL;
        }
        n = vs.len / 8;
    } else {
        sbase = (uintptr_t)PyLong_AsUnsignedLongLong(args[1]);
    }
    if (PyErr_Occurred()) {
        if (dbuf)
            PyBuffer_Release(&vd);
        if (sbuf)
            PyBuffer_Release(&vs);
        return NULL;
    }
    const uint64_t *da = dbuf ? (const uint64_t *)vd.buf : NULL;
    const uint64_t *sa = sbuf ? (const uint64_t *)vs.buf : NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        char *d = (char *)(da ? (uintptr_t)da[i] : dbase + (uintptr_t)i * (uintptr_t)length);
        const char *s = (const char *)(sa ? (uintptr_t)sa[i] : sbase + (uintptr_t)i * (uintptr_t)length);
        memcpy(d, s, (size_t)length);
    }
    Py_END_ALLOW_THREADS
    if (dbuf)
        PyBuffer_Release(&vd);
    if (sbuf)
        PyBuffer_Release(&vs);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL,
     "scan(ids, out) -> (lowest, highest, consecutive) or None"},
    {"scan_batch", (PyCFunction)(void (*)(void))scan_batch, METH_FASTCALL,
     "scan_batch(requests, bounds) -> bytearray of 2 x n int64, or None"},
    {"runs", (PyCFunction)(void (*)(void))runs, METH_FASTCALL,
     "runs(ids, bounds, seen, src_blocks, dst_blocks, out, run_bounds) -> runs, 0 or -1"},
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL,
     "copy(dst, src, length): pieces between address lists and contiguous ranges"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_kvr_idscan", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__kvr_idscan(void) { return PyModule_Create(&module); }
