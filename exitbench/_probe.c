/* Vector arithmetic of the decoding-free exit rules for one token on the CPU, in C.
 *
 * At batch size 1 on a small model a core iteration costs ~180 µs, most of it Python and torch dispatch, and
 * a probe must stay under 2% of that. Torch or numpy spend a microsecond or more per call just to get at a
 * 128-float state (see bench/RESULTS.md); these functions take the states by address (torch's data_ptr())
 * and cost a C call. The caller, exitbench/policies/latent.py, passes contiguous CPU float32 tensors that it
 * keeps alive for the call, and their element count. Sums run in double: float32 products are exact in
 * double, so a step of 1e-6 next to a state of norm 10 survives.
 *
 * Built as the optional extension exitbench._probe; without it the rules run on torch tensors.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

/* args = (address, ..., count): `n_ptrs` non-null addresses of float32 buffers, then their length. */
static int parse(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t n_ptrs, const float **ptrs, Py_ssize_t *n,
                 const char *name) {
    if (nargs != n_ptrs + 1) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd addresses and a length, got %zd arguments", name, n_ptrs,
                     nargs);
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
    *n = PyLong_AsSsize_t(args[n_ptrs]);
    if (*n == -1 && PyErr_Occurred())
        return -1;
    if (*n < 1) {
        PyErr_Format(PyExc_ValueError, "%s: length must be >= 1, got %zd", name, *n);
        return -1;
    }
    return 0;
}

static PyObject *sqnorm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const float *p[1];
    Py_ssize_t n;
    if (parse(args, nargs, 1, p, &n, "sqnorm") < 0)
        return NULL;
    double acc = 0.0;
    for (Py_ssize_t i = 0; i < n; i++)
        acc += (double)p[0][i] * p[0][i];
    return PyFloat_FromDouble(acc);
}

static PyObject *sqdist(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const float *p[2];
    Py_ssize_t n;
    if (parse(args, nargs, 2, p, &n, "sqdist") < 0)
        return NULL;
    double acc = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double d = (double)p[0][i] - p[1][i];
        acc += d * d;
    }
    return PyFloat_FromDouble(acc);
}

/* ‖(a − b) − (b − c)‖²: the change of the step, from three consecutive states. */
static PyObject *sqdist2(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const float *p[3];
    Py_ssize_t n;
    if (parse(args, nargs, 3, p, &n, "sqdist2") < 0)
        return NULL;
    double acc = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double b = p[1][i];
        double e = ((double)p[0][i] - b) - (b - p[2][i]);
        acc += e * e;
    }
    return PyFloat_FromDouble(acc);
}

/* ½‖a/‖a‖ − b/‖b‖‖² = 1 − cos(a, b), without the cancellation of computing 1 − cos; 1 when either is zero. */
static PyObject *cosgap(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const float *p[2];
    Py_ssize_t n;
    if (parse(args, nargs, 2, p, &n, "cosgap") < 0)
        return NULL;
    double na = 0.0, nb = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        na += (double)p[0][i] * p[0][i];
        nb += (double)p[1][i] * p[1][i];
    }
    na = sqrt(na);
    nb = sqrt(nb);
    if (na < 1e-12 || nb < 1e-12)
        return PyFloat_FromDouble(1.0);
    double acc = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double d = p[0][i] / na - p[1][i] / nb;
        acc += d * d;
    }
    return PyFloat_FromDouble(0.5 * acc);
}

static PyMethodDef methods[] = {
    {"sqnorm", (PyCFunction)(void (*)(void))sqnorm, METH_FASTCALL, "sqnorm(a, n) -> ‖a‖² (float32 buffer at address a)."},
    {"sqdist", (PyCFunction)(void (*)(void))sqdist, METH_FASTCALL, "sqdist(a, b, n) -> ‖a − b‖²."},
    {"sqdist2", (PyCFunction)(void (*)(void))sqdist2, METH_FASTCALL, "sqdist2(a, b, c, n) -> ‖(a − b) − (b − c)‖²."},
    {"cosgap", (PyCFunction)(void (*)(void))cosgap, METH_FASTCALL, "cosgap(a, b, n) -> 1 − cos(a, b), 1 if either is 0."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "exitbench._probe",
                                    "Exit-rule vector arithmetic on float32 buffers by address.", -1, methods};

PyMODINIT_FUNC PyInit__probe(void) { return PyModule_Create(&module); }
