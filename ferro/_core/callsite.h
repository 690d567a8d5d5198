/* The user's call site of a collective: the innermost Python frame whose file lies outside the library.
 *
 * The flight recorder stores it with every call, so it has to cost what a few pointer loads cost, not what
 * sys._getframe() costs (which makes a frame object, about 100 ns on 3.11: several times the whole budget of a
 * 4-byte shared-memory allreduce's 1 %). The interpreter's own frame chain is read where the version's layout is
 * known (3.10 to 3.13, each checked by a build and a call-site test); any other version takes the public API,
 * correct but slower. What is kept is the code
 * object (a strong reference, so its address cannot be reused while recorded) and the byte offset of the
 * instruction running in it; ferro.collective.flight_recorder turns them into file:line only when it dumps.
 *
 * Which files are the library's is decided by their path's prefix (ferro's package folder, and any the
 * interop layer adds, such as torch.distributed's), once per file name: a small cache keyed by the file-name
 * object, which it holds a reference to, so a cached address always means the same name.
 */
#ifndef FERRO_CALLSITE_H
#define FERRO_CALLSITE_H

#include <Python.h>

/* FERRO_CALLSITE_PUBLIC forces the public-API path (how it is tested on a version with a known layout). */
#if !defined(FERRO_CALLSITE_PUBLIC) && PY_VERSION_HEX >= 0x030A0000 && PY_VERSION_HEX < 0x030B0000
#  define FERRO_CALLSITE_310 1
#  include <frameobject.h> /* 3.10: the frame's fields are public */
#elif !defined(FERRO_CALLSITE_PUBLIC) && PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000
#  define FERRO_CALLSITE_INTERNAL 1
#  ifndef Py_BUILD_CORE
#    define Py_BUILD_CORE 1
#    define FERRO_UNDEF_BUILD_CORE 1
#  endif
#  include "internal/pycore_frame.h"
#  ifdef FERRO_UNDEF_BUILD_CORE
#    undef Py_BUILD_CORE
#    undef FERRO_UNDEF_BUILD_CORE
#  endif
#endif

#define FERRO_CALLSITE_PREFIXES 4
#define FERRO_CALLSITE_CACHE 256
#define FERRO_CALLSITE_DEPTH 64 /* frames looked at before giving up (a library frame deeper than any real one) */

typedef struct {
    PyObject *prefixes[FERRO_CALLSITE_PREFIXES]; /* str: folders whose files are the library's */
    int n_prefixes;
    PyObject *names[FERRO_CALLSITE_CACHE];       /* file-name objects seen (strong references) */
    char library[FERRO_CALLSITE_CACHE];          /* whether names[i] lies under a prefix */
    /* The last answer, for a call made again from the same place: a loop calling a collective has the same
     * library frame (at the same address of the frame stack) right above the same user frame, at the same
     * instruction. Compared as addresses only, never dereferenced unless they match the live frames. */
    const void *last_top, *last_user, *last_at;
    PyObject *last_top_code, *last_code;
    int last_offset;
} ferro_callsite_table;

/* Whether a file name lies under one of the table's prefixes, cached by the name object. */
static int ferro_callsite_is_library(ferro_callsite_table *t, PyObject *filename) {
    size_t slot = (((size_t)filename) >> 4) % FERRO_CALLSITE_CACHE;
    int i, found = 0;
    if (t->names[slot] == filename) return t->library[slot];
    for (i = 0; i < t->n_prefixes && !found; i++) {
        Py_ssize_t hit = PyUnicode_Tailmatch(filename, t->prefixes[i], 0, PY_SSIZE_T_MAX, -1);
        if (hit < 0) { PyErr_Clear(); hit = 0; }
        found = (int)hit;
    }
    Py_INCREF(filename);
    Py_XDECREF(t->names[slot]);
    t->names[slot] = filename;
    t->library[slot] = (char)found;
    return found;
}

/* Set *code (a borrowed reference, alive while the call runs; or NULL) and *offset (bytes into its instructions)
 * to the innermost frame of the calling thread outside the library. Needs the GIL. Never raises. */
static inline void ferro_callsite(ferro_callsite_table *t, PyObject **code, int *offset) {
    int depth = 0;
    *code = NULL;
    *offset = -1;
#if defined(FERRO_CALLSITE_INTERNAL)
    PyThreadState *ts = PyThreadState_GET();
#  if PY_VERSION_HEX >= 0x030D0000
    _PyInterpreterFrame *f = ts->current_frame;
#  else
    _PyInterpreterFrame *f = ts->cframe->current_frame;
#  endif
#  if PY_VERSION_HEX >= 0x030D0000
#    define FERRO_FRAME_AT(frame) ((const void *)(frame)->instr_ptr)
#    define FERRO_FRAME_CODE(frame) ((PyObject *)(frame)->f_executable)
#  else
#    define FERRO_FRAME_AT(frame) ((const void *)(frame)->prev_instr)
#    define FERRO_FRAME_CODE(frame) ((PyObject *)(frame)->f_code)
#  endif
    if (f != NULL && f == t->last_top && f->previous == t->last_user && f->previous != NULL
            && FERRO_FRAME_CODE(f) == t->last_top_code && FERRO_FRAME_CODE(f->previous) == t->last_code
            && FERRO_FRAME_AT(f->previous) == t->last_at) {
        *code = t->last_code;  /* the live frame's code, so never a stale address */
        *offset = t->last_offset;
        return;
    }
    _PyInterpreterFrame *top = f;
    for (; f != NULL && depth < FERRO_CALLSITE_DEPTH; f = f->previous, depth++) {
#  if PY_VERSION_HEX >= 0x030D0000
        if (f->owner == FRAME_OWNED_BY_CSTACK || !PyCode_Check(f->f_executable)) continue;
        PyCodeObject *c = (PyCodeObject *)f->f_executable;
        _Py_CODEUNIT *at = f->instr_ptr;
#  elif PY_VERSION_HEX >= 0x030C0000
        if (f->owner == FRAME_OWNED_BY_CSTACK) continue;
        PyCodeObject *c = f->f_code;
        _Py_CODEUNIT *at = f->prev_instr;
#  else
        PyCodeObject *c = f->f_code;
        _Py_CODEUNIT *at = f->prev_instr;
#  endif
        if (ferro_callsite_is_library(t, c->co_filename)) continue;
        *code = (PyObject *)c;
        *offset = (int)((char *)at - (char *)_PyCode_CODE(c));
        if (top != NULL && top->previous == f) {  /* remember the common case: the user's frame right above */
            t->last_top = top;
            t->last_top_code = FERRO_FRAME_CODE(top);
            t->last_user = f;
            t->last_at = at;
            t->last_code = *code;  /* compared by address only, as above */
            t->last_offset = *offset;
        }
        return;
    }
#elif defined(FERRO_CALLSITE_310)
    PyFrameObject *f = PyThreadState_GET()->frame;
    for (; f != NULL && depth < FERRO_CALLSITE_DEPTH; f = f->f_back, depth++) {
        if (ferro_callsite_is_library(t, f->f_code->co_filename)) continue;
        *code = (PyObject *)f->f_code;
        *offset = f->f_lasti * 2; /* 3.10 counts instructions of two bytes */
        return;
    }
#else
    PyFrameObject *f = PyEval_GetFrame(); /* borrowed */
    Py_XINCREF(f);
    while (f != NULL && depth < FERRO_CALLSITE_DEPTH) {
        PyCodeObject *c = PyFrame_GetCode(f);
        if (!ferro_callsite_is_library(t, c->co_filename)) {
            *code = (PyObject *)c;  /* the frame, alive while the call runs, keeps it */
            *offset = PyFrame_GetLasti(f);
            Py_DECREF(c);
            Py_DECREF(f);
            return;
        }
        Py_DECREF(c);
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
        depth++;
    }
    Py_XDECREF(f);
#endif
}

#endif
