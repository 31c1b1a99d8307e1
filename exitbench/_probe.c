/* Vector arithmetic of the decoding-free exit rules on the CPU, in C, one value per token.
 *
 * At batch size 1 on a small model a core iteration costs ~180 µs, most of it Python and torch dispatch, and
 * a probe must stay under 2% of that. Torch or numpy spend a microsecond or more per call just to get at a
 * 128-float state (see bench/RESULTS.md); these functions take the states by address (torch's data_ptr())
 * and cost a C call. The caller, exitbench/policies/host.py, passes contiguous CPU float32 (rows, width)
 * tensors that it keeps alive for the call. Sums run in double: float32 products are exact in double, so a
 * step of 1e-6 next to a state of norm 10 survives.
 *
 * Built as the optional extension exitbench._probe; without it the rules run on torch tensors.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

/* args = (address, ..., rows, width[, relative]): `n_ptrs` non-null addresses of (rows, width) float32
 * buffers; `relative` (0 or 1) where the rule may divide by the norm of the first buffer's row. */
static int parse(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t n_ptrs, int takes_relative, const float **ptrs,
                 Py_ssize_t *rows, Py_ssize_t *width, int *relative, const char *name) {
    if (nargs != n_ptrs + 2 + takes_relative) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd addresses, rows, width%s, got %zd arguments", name, n_ptrs,
                     takes_relative ? " and relative" : "", nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n_ptrs; i++) {
        ptrs[i] = (const float *)PyLong_AsVoidPtr(args[i]);
        if (ptrs[i] == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "%s: address %zd is null (an empty tensor?)", name, i);
            return -1;
        }
    }
    *rows = PyLong_AsSsize_t(args[n_ptrs]);
    *width = PyLong_AsSsize_t(args[n_ptrs + 1]);
    if ((*rows == -1 || *width == -1) && PyErr_Occurred())
        return -1;
    if (*rows < 1 || *width < 1) {
        PyErr_Format(PyExc_ValueError, "%s: rows and width must be >= 1, got %zd and %zd", name, *rows, *width);
        return -1;
    }
    *relative = 0;
    if (takes_relative && (*relative = PyObject_IsTrue(args[n_ptrs + 2])) < 0)
        return -1;
    return 0;
}

static double sqnorm(const float *a, Py_ssize_t n) {
    double acc = 0.0;
    for (Py_ssize_t i = 0; i < n; i++)
        acc += (double)a[i] * a[i];
    return acc;
}

static double dist(const float **p, Py_ssize_t n) {
    double acc = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double d = (double)p[0][i] - p[1][i];
        acc += d * d;
    }
    return sqrt(acc);
}

/* ‖(a − b) − (b − c)‖, the change of the step, from three consecutive states. */
static double dist2(const float **p, Py_ssize_t n) {
    double acc = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double b = p[1][i];
        double e = ((double)p[0][i] - b) - (b - p[2][i]);
        acc += e * e;
    }
    return sqrt(acc);
}

/* |‖a − b‖ − ‖b − c‖|, the change of the step's length. */
static double stepgap(const float **p, Py_ssize_t n) {
    const float *later[2] = {p[1], p[2]};
    return fabs(dist(p, n) - dist(later, n));
}

/* ½‖a/‖a‖ − b/‖b‖‖² = 1 − cos(a, b), without the cancellation of computing 1 − cos; 1 when either is zero. */
static double cosgap(const float **p, Py_ssize_t n) {
    double na = sqrt(sqnorm(p[0], n)), nb = sqrt(sqnorm(p[1], n));
    if (na < 1e-12 || nb < 1e-12)
        return 1.0;
    double acc = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double d = p[0][i] / na - p[1][i] / nb;
        acc += d * d;
    }
    return 0.5 * acc;
}

/* One value per row, as a list (the loop's batch is at most a few dozen rows). Relative values divide by
 * ‖a_r‖ with IEEE semantics, as torch does: x/0 = inf, 0/0 = nan. */
typedef double (*row_fn)(const float **p, Py_ssize_t width);

static PyObject *per_row(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t n_ptrs, int takes_relative, row_fn fn,
                         const char *name) {
    const float *p[3];
    Py_ssize_t rows, width;
    int relative;
    if (parse(args, nargs, n_ptrs, takes_relative, p, &rows, &width, &relative, name) < 0)
        return NULL;
    PyObject *out = PyList_New(rows);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t r = 0; r < rows; r++) {
        double v = fn(p, width);
        if (relative)
            v /= sqrt(sqnorm(p[0], width));
        PyObject *value = PyFloat_FromDouble(v);
        if (value == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, r, value);
        for (Py_ssize_t i = 0; i < n_ptrs; i++)
            p[i] += width;
    }
    return out;
}

static PyObject *py_dist(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return per_row(args, nargs, 2, 1, dist, "dist");
}
static PyObject *py_dist2(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return per_row(args, nargs, 3, 1, dist2, "dist2");
}
static PyObject *py_stepgap(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return per_row(args, nargs, 3, 1, stepgap, "stepgap");
}
static PyObject *py_cosgap(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return per_row(args, nargs, 2, 1, cosgap, "cosgap");  /* relative is always 0: one signature for all */
}

#define FASTCALL(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL
static PyMethodDef methods[] = {
    {"dist", FASTCALL(py_dist), "dist(a, b, rows, width, relative) -> [‖a_r − b_r‖ (/ ‖a_r‖)] for (rows, width) "
                                "float32 buffers at addresses a, b."},
    {"dist2", FASTCALL(py_dist2), "dist2(a, b, c, rows, width, relative) -> [‖(a_r − b_r) − (b_r − c_r)‖ (/ ‖a_r‖)]."},
    {"stepgap", FASTCALL(py_stepgap), "stepgap(a, b, c, rows, width, relative) -> [|‖a_r − b_r‖ − ‖b_r − c_r‖| (/ ‖a_r‖)]."},
    {"cosgap", FASTCALL(py_cosgap), "cosgap(a, b, rows, width, relative) -> [1 − cos(a_r, b_r)], 1 where either is 0."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "exitbench._probe",
                                    "Exit-rule vector arithmetic on float32 row buffers by address.", -1, methods};

PyMODINIT_FUNC PyInit__probe(void) { return PyModule_Create(&module); }
