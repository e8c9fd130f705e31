"""Frame normalisation: make the same code look the same on every host and every Python.

Readers call :func:`normalize_file` on every file name they read, so that
``/opt/conda/lib/python3.8/site-packages/torch/distributed/distributed_c10d.py`` (full names,
faulthandler, tracebacks) and ``torch/distributed/distributed_c10d.py`` (py-spy's short names)
compare equal, and ``/usr/lib/python3.11/threading.py`` becomes ``threading.py`` like py-spy prints
it. :func:`is_plumbing` says which frames are library plumbing (launcher wrappers, runpy, thread
bootstrap, torch's module-call dispatch, the interpreter's own C frames): kept in the stack, but a
renderer may fold them and a summary skips them.

    >>> normalize_file("/opt/conda/lib/python3.8/site-packages/torch/distributed/c10d_logger.py")
    'torch/distributed/c10d_logger.py'
    >>> normalize_file("/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py")
    'threading.py'
    >>> normalize_file("/home/alice/proj/train.py")
    '~/proj/train.py'
    >>> from hangdoc.model import Frame
    >>> is_plumbing(Frame("_exception_logger.<locals>.wrapper", "torch/distributed/c10d_logger.py", 83))
    True
    >>> is_plumbing(Frame("train_step", "train.py", 28))
    False
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import TYPE_CHECKING, Dict, Iterable, List

from hangdoc.cmdline import launcher_name, split

if TYPE_CHECKING:  # pragma: no cover
    from hangdoc.model import Frame, Process

_PACKAGES_RE = re.compile(r"^.*?/(?:site|dist)-packages/")
# .../lib/python3.11/x.py, .../lib64/python3.8/x.py, .../Lib/x.py (Windows)
_STDLIB_RE = re.compile(r"^.*?/lib(?:64)?/python\d+(?:\.\d+)?[a-z]?/")
_HOME_RE = re.compile(r"^/(?:home|Users)/[^/]+/")
_ROOT_HOME_RE = re.compile(r"^/root/")


@lru_cache(maxsize=65536)
def normalize_file(path: str) -> str:
    """A file name that compares equal across hosts, Python versions and dumpers.

    * ``.../site-packages/`` or ``.../dist-packages/`` prefixes are stripped (the package path stays);
    * ``.../lib/python3.X/`` standard-library prefixes are stripped (``threading.py``);
    * ``/home/USER/`` and ``/root/`` become ``~/``;
    * anything else (``<frozen runpy>``, ``<string>``, relative names, C libraries) is left alone.

    >>> normalize_file("C:\\\\Python311\\\\Lib\\\\site-packages\\\\torch\\\\nn\\\\modules\\\\module.py")
    'torch/nn/modules/module.py'
    >>> normalize_file("<frozen runpy>")
    '<frozen runpy>'
    """
    if not path or path[0] == "<":
        return path
    if "\\" in path and "/" not in path:
        path = path.replace("\\", "/")
        path = re.sub(r"^.*?/Lib/(site-packages/)?", lambda m: "/lib/python3/" + (m.group(1) or ""), path)
    m = _PACKAGES_RE.match(path)
    if m:
        return path[m.end():]
    m = _STDLIB_RE.match(path)
    if m:
        return path[m.end():]
    m = _HOME_RE.match(path) or _ROOT_HOME_RE.match(path)
    if m:
        return "~/" + path[m.end():]
    return path


def common_suffixes(files: Iterable[str]) -> Dict[str, str]:
    """Map file names that are one file printed at different lengths to their shortest form.

    py-spy prints ``stopped_rank.py`` where faulthandler or a traceback of the same job prints
    ``/work/main/examples/hangs/stopped_rank.py``. A name maps to a shorter one when the shorter is
    a suffix of it on a ``/`` boundary and every name with that suffix is a suffix of one another
    (one file, several lengths); two different files that share a short name (``/a/train.py``,
    ``/b/train.py`` and ``train.py``) stay apart. The result depends only on the set of names.

    >>> sorted(common_suffixes(["/work/ex/hangs/stopped_rank.py", "stopped_rank.py", "hangs/stopped_rank.py", "train.py"]).items())
    [('/work/ex/hangs/stopped_rank.py', 'stopped_rank.py'), ('hangs/stopped_rank.py', 'stopped_rank.py')]
    >>> common_suffixes(["/a/train.py", "/b/train.py", "train.py"])
    {}
    """
    names = {f for f in files if f and f[0] != "<"}
    by_base: Dict[str, List[str]] = {}
    for f in names:
        by_base.setdefault(f.rsplit("/", 1)[-1], []).append(f)
    out: Dict[str, str] = {}
    for same in by_base.values():
        if len(same) < 2:
            continue
        same.sort(key=len)
        short = same[0]
        longest = same[-1]
        # one file at several lengths: each name is a suffix of the longest, and the shortest of each
        if all(_suffix_match(longest, f) for f in same) and all(_suffix_match(f, short) for f in same):
            for f in same[1:]:
                if f != short:
                    out[f] = short
    return out


# Python frames that are plumbing: (function name, file suffix). The function is compared both as
# py-spy prints it (``Thread._bootstrap``, a qualified name) and as faulthandler, tracebacks and
# pystack print it (``_bootstrap``, the bare name).
_PLUMBING_PY = {
    # torch.distributed's logging wrappers around every collective
    ("_exception_logger.<locals>.wrapper", "torch/distributed/c10d_logger.py"),
    ("_time_logger.<locals>.wrapper", "torch/distributed/c10d_logger.py"),
    ("wrapper", "torch/distributed/c10d_logger.py"),
    # the torchrun launcher / elastic agent
    ("record.<locals>.wrap.<locals>.wrapper", "torch/distributed/elastic/multiprocessing/errors/__init__.py"),
    ("wrapper", "torch/distributed/elastic/multiprocessing/errors/__init__.py"),
    ("prof.<locals>.wrap.<locals>.wrapper", "torch/distributed/elastic/metrics/api.py"),
    ("wrapper", "torch/distributed/elastic/metrics/api.py"),
    # nn.Module call dispatch and context-manager decorators
    ("Module._call_impl", "torch/nn/modules/module.py"),
    ("Module._wrapped_call_impl", "torch/nn/modules/module.py"),
    ("_call_impl", "torch/nn/modules/module.py"),
    ("_wrapped_call_impl", "torch/nn/modules/module.py"),
    ("Module.__call__", "torch/nn/modules/module.py"),
    ("context_decorator.<locals>.decorate_context", "torch/utils/_contextlib.py"),
    ("decorate_context", "torch/utils/_contextlib.py"),
    ("_DecoratorContextManager.__call__.<locals>.decorate_context", "torch/utils/_contextlib.py"),
    # running a module or script
    ("_run_code", "runpy.py"),
    ("_run_module_as_main", "runpy.py"),
    ("_run_module_code", "runpy.py"),
    ("run_module", "runpy.py"),
    ("run_path", "runpy.py"),
    # thread and process bootstrap
    ("Thread._bootstrap", "threading.py"),
    ("Thread._bootstrap_inner", "threading.py"),
    ("Thread.run", "threading.py"),
    ("_bootstrap", "threading.py"),
    ("_bootstrap_inner", "threading.py"),
    ("run", "threading.py"),
    ("BaseProcess._bootstrap", "multiprocessing/process.py"),
    ("BaseProcess.run", "multiprocessing/process.py"),
    ("BaseProcess.start", "multiprocessing/process.py"),
    ("_bootstrap", "multiprocessing/process.py"),
    ("run", "multiprocessing/process.py"),
    ("start", "multiprocessing/process.py"),
    ("Popen._launch", "multiprocessing/popen_fork.py"),
    ("Popen.__init__", "multiprocessing/popen_fork.py"),
    ("_launch", "multiprocessing/popen_fork.py"),
    ("__init__", "multiprocessing/popen_fork.py"),
    ("ForkProcess._Popen", "multiprocessing/context.py"),
    ("_Popen", "multiprocessing/context.py"),
    # hangdoc's collective recorder: its wrapper around each collective is generated code, so
    # faulthandler and py-spy name its file <string> (hangdoc/runtime/recorder.py, _make_fast_wrapper)
    ("wrapper", "<string>"),
    ("factory.<locals>.wrapper", "<string>"),
    ("_WorkItem.run", "concurrent/futures/thread.py"),
    ("_worker", "concurrent/futures/thread.py"),
    ("run", "concurrent/futures/thread.py"),
}
_PLUMBING_FILES_ANY_FUNCTION = ("<frozen runpy>",)

# C frames of the interpreter, libc start-up and binding glue: never where a hang is decided.
_PLUMBING_NATIVE_RE = re.compile(
    r"^(?:_?Py[A-Z_]\w*|_Py\w+|py?main_\w+|pymain_\w+|Py_BytesMain|Py_RunMain|run_mod|run_eval_code_obj|"
    r"pyrun_\w+|method_vectorcall\w*|cfunction_\w+|vectorcall\w*|slot_tp_\w+|_start|__libc_start_\w+|"
    r"__libc_start_call_main|start_thread|clone3?|thread_run|pythread_wrapper|"
    r"pybind11::cpp_function::dispatcher|pybind11::cpp_function::initialize)"
)


def _suffix_match(file: str, suffix: str) -> bool:
    return file == suffix or file.endswith("/" + suffix)


# hangdoc's own in-job code: its CLI and ``python -m hangdoc`` around the user's script, the
# collective recorder's wrapper around every collective, its watchdog / prefix / detector threads.
_HANGDOC_OWN_RE = re.compile(r"(?:^|/)hangdoc/(?:runtime/[\w.]+\.py|cli/[\w.]+\.py|__main__\.py)$")


def is_hangdoc_file(file: str) -> bool:
    """True for a file of hangdoc's own in-job code (``hangdoc/runtime/*``, ``hangdoc/cli/*``, ``__main__``).

    >>> is_hangdoc_file("/work/main/hangdoc/runtime/recorder.py"), is_hangdoc_file("hangdoc/cli/run.py")
    (True, True)
    >>> is_hangdoc_file("train.py"), is_hangdoc_file("myhangdoc/runtime/x.py")
    (False, False)
    """
    return bool(file) and "hangdoc/" in file and bool(_HANGDOC_OWN_RE.search(file))


def is_hangdoc_thread(frames: Iterable["Frame"]) -> bool:
    """A thread hangdoc started (watchdog, output-prefix reader, detector): the first frame past
    the thread bootstrap is hangdoc's own code.

    >>> from hangdoc.model import Frame
    >>> is_hangdoc_thread((Frame("_bootstrap", "threading.py", 1002), Frame("run", "threading.py", 982),
    ...                    Frame("_run", "/work/main/hangdoc/runtime/prefix.py", 144)))
    True
    >>> is_hangdoc_thread((Frame("_bootstrap", "threading.py", 1002), Frame("run", "threading.py", 982),
    ...                    Frame("loader", "train.py", 7), Frame("wrapper", "hangdoc/runtime/recorder.py", 670)))
    False
    """
    for f in frames:
        if is_hangdoc_file(f.file):
            return True
        if f.native or _plumbing(f.function, f.file, f.native):
            continue
        return False
    return False


@lru_cache(maxsize=65536)
def _plumbing(function: str, file: str, native: bool) -> bool:
    if native:
        return bool(_PLUMBING_NATIVE_RE.match(function))
    if file in _PLUMBING_FILES_ANY_FUNCTION:
        return True
    if "hangdoc/" in file and _HANGDOC_OWN_RE.search(file):
        return True
    for name, suffix in _PLUMBING_PY:
        if function == name and _suffix_match(file, suffix):
            return True
    return False


def is_plumbing(frame: "Frame") -> bool:
    """True for frames that only pass a call through (wrappers, bootstrap, dispatch).

    >>> from hangdoc.model import Frame
    >>> is_plumbing(Frame("Thread._bootstrap", "threading.py", 1002))
    True
    >>> is_plumbing(Frame("_run_code", "<frozen runpy>", 88))
    True
    >>> is_plumbing(Frame("_PyEval_EvalFrameDefault", "libpython3.11.so.1.0", native=True))
    True
    >>> is_plumbing(Frame("c10d::Work::wait", "libtorch_cpu.so", native=True))
    False
    >>> is_plumbing(Frame("wrapper", "/work/main/hangdoc/runtime/recorder.py", 670))  # hangdoc's own
    True
    >>> is_plumbing(Frame("wrapper", "<string>", 69))  # the recorder's generated wrapper
    True
    """
    return _plumbing(frame.function, frame.file, frame.native)


# --- roles -------------------------------------------------------------------------------------

_WORKER_FUNCTIONS = frozenset({"_worker_loop"})
_LAUNCHER_FILES = (
    "torch/distributed/run.py",
    "torch/distributed/launch.py",
    "torch/distributed/elastic/agent/server/api.py",
    "torch/distributed/launcher/api.py",
)


def is_worker_stack(frames: Iterable["Frame"]) -> bool:
    """A DataLoader worker: ``_worker_loop`` of ``torch/utils/data/_utils/worker.py`` in the stack."""
    for f in frames:
        if f.function in _WORKER_FUNCTIONS and (not f.file or f.file.endswith("worker.py")):
            return True
    return False


def is_pool_worker_stack(frames: Iterable["Frame"]) -> bool:
    """A ``multiprocessing`` pool's worker (``worker`` of ``multiprocessing/pool.py``): a helper
    process a rank forked, never a rank of its own.

    >>> from hangdoc.model import Frame
    >>> is_pool_worker_stack((Frame("main", "train.py", 72), Frame("worker", "multiprocessing/pool.py", 114)))
    True
    """
    for f in frames:
        if f.function.rsplit(".", 1)[-1] == "worker" and f.file and _suffix_match(f.file.replace("\\", "/"), "multiprocessing/pool.py"):
            return True
    return False


def is_launcher_stack(frames: Iterable["Frame"]) -> bool:
    """torchrun / ``torch.distributed.launch`` / the elastic agent."""
    for f in frames:
        for suffix in _LAUNCHER_FILES:
            if _suffix_match(f.file, suffix):
                return True
    return False


@lru_cache(maxsize=4096)
def _runs_launcher(command: str) -> bool:
    # every rank of a job prints the same command line: parsed once, not 131,072 times
    return launcher_name(split(command)) is not None


def role_of(process: "Process") -> str:
    """What a process is, from its stacks and command line: rank, DataLoader worker or launcher.

    >>> from hangdoc.model import Frame, Thread, Process
    >>> t = Thread(frames=(Frame("_worker_loop", "torch/utils/data/_utils/worker.py", 334),), is_main=True)
    >>> role_of(Process(threads=[t]))
    'dataloader-worker'
    >>> role_of(Process(command="python /home/u/torchrun/train.py")), role_of(Process(command="/venv/bin/python /venv/bin/torchrun t.py"))
    ('rank', 'launcher')
    """
    from hangdoc.model import ROLE_LAUNCHER, ROLE_RANK, ROLE_UNKNOWN, ROLE_WORKER

    # A worker is forked from its rank: only its main thread says what it runs (the other threads
    # are the worker's own), and a worker's main thread also shows the rank's frames up to the fork.
    main = process.main_thread
    if main is not None and is_worker_stack(main.frames):
        return ROLE_WORKER
    cmd = process.command
    # what the command runs, not a substring of it: `python /home/u/torchrun-exps/train.py` is a rank
    if (cmd and _runs_launcher(cmd)) or (main is not None and is_launcher_stack(main.frames)):
        return ROLE_LAUNCHER
    # A process the dumper could not read still has a command line when py-spy printed its
    # "Process N: cmd" line: the launcher's children are the ranks.
    if process.rank is not None or process.command or any(t.frames for t in process.threads):
        return ROLE_RANK
    return ROLE_UNKNOWN
