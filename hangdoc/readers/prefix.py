"""Line prefixes: what launchers put in front of every line, peeled off before any format sees it.

A console log rarely holds a program's lines as printed. torchrun ``--tee`` writes ``[default3]:``,
torch itself ``[rank3]: ``, hangdoc ``[node7:3] ``, torchrun's ``--log-line-prefix-template``
``[vm:0]:``, ``srun --label`` ``12: ``, pdsh/clush and DeepSpeed's runner ``node7: ``/``worker-3: ``,
mpirun ``--tag-output`` ``[1,0]<stderr>:``, ``kubectl logs --prefix`` ``[pod/trainer-0/main] ``;
and around any of them a timestamp, a logger's own head (``E0207 07:54:31.862000 4712 run.py:939] ``,
``ERROR 01-29 20:00:47 utils.py:240] ``), a ``[12345] `` pid, a ``> `` of a quoted paste, ANSI colour
codes, or a progress bar that ended in ``\\r`` without a newline. They stack
(``node7: [default1]:[rank1]: Traceback ...``).

:class:`Peeler` takes them off one layer at a time, outermost first, and says who wrote the line:
``(host, rank, local_rank)`` of the innermost layer that names each (srun's task id is the rank
only when no inner layer names one). Lines with the same identity form a *channel*, so the
interleaved lines of many ranks come apart. A label that only this file uses (``gpu-node-12: ``) is
learnt from the file's first lines: a ``label: `` in front of many lines, whose labels vary and end
in a number, is a prefix there.

Every pattern is anchored and linear (no nested or unbounded lazy repetition), and each line is
peeled at most :data:`MAX_LAYERS` times.

    >>> p = Peeler()
    >>> p.learn(["node7: [default1]:[rank1]: a", "node8: [default0]:[rank2]: b"])
    >>> p.peel("node7: [default1]:[rank1]: Traceback (most recent call last):")
    (('node7', 1, 1), 'Traceback (most recent call last):')
    >>> p.peel("\\x1b[31m2024-05-01T10:00:00.123Z [rank0]: hello\\x1b[0m")
    ((None, 0, None), 'hello')
    >>> p.peel("Epoch 0:  6%|##   | 32/500\\r[rank0]: Watchdog caught collective operation timeout")
    ((None, 0, None), 'Watchdog caught collective operation timeout')
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable, List, Optional, Tuple

#: (host, rank, local_rank) of a line's writer; all None for a line without identity
Identity = Tuple[Optional[str], Optional[int], Optional[int]]
NO_IDENTITY: Identity = (None, None, None)

#: layers peeled off one line at most (a deeper stack of prefixes is left as text)
MAX_LAYERS = 8
#: lines of a file's head that :meth:`Peeler.learn` looks at
LEARN_LINES = 4000
#: a number in a prefix larger than this is no rank (a pid, a year): identity is left unset
MAX_RANK = 1 << 22
#: what :meth:`Peeler.learn` made of a line, for lines of up to MEMO_CHARS characters, shared by
#: every file read (the lines of a node's dump are mostly those of every other node's): at most
#: MEMO_LINES of them, forgotten all at once when full
MEMO_LINES = 1 << 14
MEMO_CHARS = 512
_LEARNT: Dict[str, Any] = {}
_BLANK = "blank"  # a line learn does not count
_NOTHING = "nothing"  # a line counted, with no label
#: first characters with which :meth:`Peeler._peel_known` peels nothing (ASCII letters but those
#: of a logger's level, E/W/I/F/D/C; a space unless a bracket follows the spaces) or the empty line
_PLAIN = frozenset("ABGHJKLMNOPQRSTUVXYZabcdefghijklmnopqrstuvwxyz \t\"'`#=-_*/\\.,;:!?@%&+~<{|}") | {""}

_ANSI_RE = re.compile(r"\x1b\[[0-?]{0,32}[ -/]{0,8}[@-~]|\x1b\][^\x07\x1b]{0,4096}(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")

# torch "[rank3]:", torchrun --tee "[default3]:" / "[trainer3]:", "[3]:"
_BRACKET_RANK_RE = re.compile(r"\[([A-Za-z_][A-Za-z_\-]{0,63})?(\d+)\]:")
# torchrun's template "[vm:0]:" and hangdoc's own "[node7:3] "
_HOST_RANK_RE = re.compile(r"\[([A-Za-z0-9][A-Za-z0-9_.\-]{0,127}):(\d+)\](:| )")
# mpirun --tag-output "[1,0]<stderr>:", horovodrun "[1]<stderr>:"
_MPI_RE = re.compile(r"\[(?:\d{1,9},)?(\d+)\]<(?:stdout|stderr|stddiag)>: ?")
# Ray's worker tag "(RayWorkerWrapper pid=14390)", "(pid=123, ip=10.0.0.2)"
_RAY_RE = re.compile(r"\((?:[A-Za-z_][A-Za-z0-9_.\-]{0,127} )?pid=(\d{1,9})(?:, ip=([0-9A-Fa-f.:]{1,64}))?\) ?")
# docker compose "trainer-1  | "
_COMPOSE_RE = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.\-]{0,127}) {1,32}\| ")
# a colour code whose ESC byte a copy lost: "[36m", "ESC[0m"
_COLOUR_RE = re.compile(r"(?:ESC)?\[\d{1,3}(?:;\d{1,3}){0,4}m")
# kubectl logs --prefix "[pod/trainer-0/main] "
_KUBECTL_RE = re.compile(r"\[pod/([A-Za-z0-9][A-Za-z0-9_.\-]{0,252})/[A-Za-z0-9_.\-]{1,253}\] ")
# a timestamp: ISO 8601 / RFC 3339 (kubectl --timestamps), optionally bracketed, or a bare clock
_TIME_RE = re.compile(
    r"\[?\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d{1,9})?(?:Z|[+-]\d{2}:?\d{2})?\]?(?: \| |:? )"
    r"|\[?\d{2}:\d{2}:\d{2}(?:[.,]\d{1,9})?\]? ")
# "[12345] " in front of a line (a pid, a paste tool's line number): no identity
_PID_RE = re.compile(r"\[\d{1,9}\] ")
# "> " of a quoted paste (">> " for a quote in a quote)
_QUOTE_RE = re.compile(r">{1,4} ?")
# Python's logging in torch's glog style: "E0207 07:54:31.862000 4712 torch/distributed/run.py:939] "
_GLOG_PY_RE = re.compile(r"[EWIFD]\d{4} \d{2}:\d{2}:\d{2}(?:\.\d{1,9})? {1,8}\d{1,9} [^\s\]]{1,512}:\d{1,9}\] ?")
# vLLM's and similar loggers: "ERROR 01-29 20:00:47 multiproc_worker_utils.py:240] "
_LEVEL_RE = re.compile(r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:\.\d{1,9})? "
                       r"[^\s\]]{1,512}:\d{1,9}\] ?")
# a candidate learnt label: "12: ", "node7: ", "worker-3: ", "gpu-node-12.cluster: "
_LABEL_RE = re.compile(r" {0,8}([A-Za-z0-9][A-Za-z0-9_.\-]{0,127}(?::\d{1,6})?): ")
_TRAILING_DIGITS_RE = re.compile(r"\d{1,9}$")
# a candidate learnt pod prefix, as stern prints it: "trainer-worker-0 pytorch " (pod, container;
# Kubernetes names are lower case)
_POD_RE = re.compile(r"([a-z0-9][a-z0-9.\-]{0,252}) ([a-z0-9][a-z0-9\-]{0,62}) ")


def strip_ansi(text: str) -> str:
    """``text`` without terminal escape sequences (colours, cursor moves, OSC titles)."""
    return _ANSI_RE.sub("", text) if "\x1b" in text else text


def _rank(num: str) -> Optional[int]:
    if len(num) > 9:  # no rank (and no int() of thousands of digits)
        return None
    n = int(num)
    return n if n < MAX_RANK else None


def _stem(label: str) -> Optional[str]:
    """The part of a label before its trailing number; None when it does not end in one."""
    m = _TRAILING_DIGITS_RE.search(label)
    return label[:m.start()] if m else None


class Peeler:
    """Peels launcher prefixes off lines; :meth:`learn` adds the labels one file uses."""

    __slots__ = ("stems", "pods", "task_is", "_learnt")

    def __init__(self) -> None:
        #: stems of learnt ``label: `` prefixes ("" for srun's bare task ids)
        self.stems: set = set()
        #: what srun's task id is in this file: "rank" (one task a rank), "node" (one task a node's
        #: launcher, its ranks named inside), or None (one task for all: it says nothing)
        self.task_is: Optional[str] = "rank"
        #: (pod stem, container) of learnt stern prefixes ``pod container ``
        self.pods: set = set()
        self._learnt = False

    def learn(self, lines: Iterable[str]) -> None:
        """Learn the ``label: `` prefixes of a file from its first lines.

        A stem (a label less its trailing number) is a prefix of this file when its labels start at
        least a fifth of the lines and either vary (``node1``, ``node2``), each starting three lines
        or more, or start most lines.

        >>> p = Peeler()
        >>> p.learn(["0: hello", "1: hello", "0: a", "1: b", "0: c", "1: d", "0: Traceback (most recent call last):"])
        >>> p.peel("1:   File \\"t.py\\", line 3, in main")
        ((None, 1, None), '  File "t.py", line 3, in main')
        >>> p = Peeler()
        >>> p.learn(["loss: 0.3", "loss: 0.2"])   # no number at the end: never a prefix
        >>> p.stems
        set()
        """
        self._learnt = True
        counts: Dict[Any, int] = {}  # stem (or (pod stem, container)) -> lines it starts
        labels: Dict[Any, set] = {}
        total = 0
        # srun's task ids against the ranks an inner layer names on the same line: a task that
        # wraps other ranks (``srun --label torchrun``) is a node, not a rank
        task_clash = False
        memo = _LEARNT
        for i, raw in enumerate(lines):
            if i >= LEARN_LINES:
                break
            got = memo.get(raw)
            if got is None:
                got = self._learn_line(raw)
                if len(raw) <= MEMO_CHARS:
                    if len(memo) >= MEMO_LINES:
                        memo.clear()
                    memo[raw] = got
            if got is _BLANK:
                continue
            total += 1
            if got is _NOTHING:
                continue
            hits, clash = got
            task_clash = task_clash or clash
            for key, label in hits:
                counts[key] = counts.get(key, 0) + 1
                labels.setdefault(key, set()).add(label)
        for stem, n in counts.items():
            distinct = len(labels[stem])
            # numbered lines that each occur once (a Rust backtrace's "  0: ", a list) are no
            # prefix: a launcher labels many lines with each label
            if n * 5 >= total and n >= 2 and ((distinct > 1 and n >= 3 * distinct) or n * 2 >= total):
                (self.pods if isinstance(stem, tuple) else self.stems).add(stem)
        tasks = len(labels.get("", ()))
        self.task_is = None if tasks <= 1 else ("node" if task_clash else "rank")

    def _learn_line(self, raw: str) -> Any:
        """What one line of a file's head tells :meth:`learn`: :data:`_BLANK` (nothing: it is not
        counted), :data:`_NOTHING` (counted, no label), or ``(((stem or pod key, label), ...), task
        clash)``. A function of the line alone (no state of the peeler), so it is memoised."""
        # learn behind the prefixes every file may have (a timestamp, ANSI, torch's own), in
        # front of a progress bar's redraws and behind them
        _, line = self._peel_known(strip_ansi(raw))
        if not line.strip():
            return _BLANK
        hits: List[Tuple[Any, str]] = []
        task_clash = False
        for part in range(2):
            tasks: List[Optional[int]] = []  # this line's srun task ids, outermost first
            for _depth in range(3):  # "worker-3: 0: r12i0n8:3: text": all three are labels
                m = _LABEL_RE.match(line)
                if m is None:
                    pod = self._pod_key(line)
                    if pod is None:
                        break
                    key, end = pod
                    hits.append((key, line[:end]))
                    _, line = self._peel_known(line[end:])
                    continue
                label = m.group(1)
                stem = _stem(label)
                if stem is None:
                    break
                hits.append((stem, label))
                inner, line = self._peel_known(line[m.end():])
                named = [_rank(v) for k, v in inner if k in ("rank", "local")]
                if ":" in label:
                    named.insert(0, _rank(label.rpartition(":")[2]))
                elif not stem:
                    named.insert(0, _rank(label))
                    tasks.append(named[0])
                # a task id with another rank named inside it wraps other ranks
                task_clash = task_clash or any(r != t for t in tasks for r in named)
            if part or "\r" not in line:
                break
            _, line = self._peel_known(line[line.rfind("\r") + 1:])
        if not hits and not task_clash:
            return _NOTHING
        return tuple(hits), task_clash

    @staticmethod
    def _pod_key(line: str) -> Optional[Tuple[Tuple[str, str], int]]:
        """``((pod stem, container), end)`` of a stern ``pod container `` head, or None."""
        if not (line[:1].islower() or line[:1].isdigit()):
            return None
        m = _POD_RE.match(line)
        if m is None:
            return None
        stem = _stem(m.group(1))
        if not stem or not stem[-1:] in "-.":  # "trainer-worker-0": a numbered replica, not "epoch3"
            return None
        return (stem, m.group(2)), m.end()

    def _peel_labelled(self, line: str, depth: int) -> Tuple[List[Tuple[str, str]], str]:
        """The known prefixes and up to ``depth`` learnt labels (each followed by known ones)."""
        found, line = self._peel_known(line)
        for _depth in range(depth if self.stems or self.pods or line[:1].isdigit() else 0):
            m = _LABEL_RE.match(line)
            if m is None:
                pod = self._pod_key(line) if self.pods else None
                if pod is None or pod[0] not in self.pods:
                    break
                found.append(("host", line[:pod[1]].split(" ", 1)[0]))
                got, line = self._peel_known(line[pod[1]:])
                found.extend(got)
                continue
            label = m.group(1)
            if _stem(label) not in self.stems:
                # not learnt (too few lines of the head carry it), but "3: [rank3]: ": a task id
                # that what is inside it confirms is srun's, wherever it occurs
                if not label.isdigit() or depth < 2:
                    break
                got, rest = self._peel_labelled(line[m.end():], depth - 1)
                named = [v for k, v in got if k in ("rank", "local")]
                if not named or _rank(named[-1]) != _rank(label):
                    break
                found.extend(got)
                return found, rest
            if label.isdigit():
                if self.task_is == "rank":
                    found.append(("task", label))
                elif self.task_is == "node":
                    # srun ran one launcher a node: the task id tells its nodes apart
                    found.append(("node", "task" + label))
            elif ":" in label:  # "r12i0n8:3: ": host and rank
                h, _, r = label.rpartition(":")
                found.append(("host", h))
                found.append(("rank", r))
            else:
                found.append(("host", label))
            got, line = self._peel_known(line[m.end():])
            found.extend(got)
        return found, line

    def _peel_known(self, line: str) -> Tuple[List[Tuple[str, str]], str]:
        """Peel the prefixes every file may carry: ``[(kind, value)]`` outermost first, and the text."""
        found: List[Tuple[str, str]] = []
        for _ in range(MAX_LAYERS):
            if not line:
                break
            c = line[0]
            if c == "[":
                m = _BRACKET_RANK_RE.match(line)
                if m and line[m.end():].strip():  # "[1]:" alone is an entry of torchrun's failure table
                    name = m.group(1) or ""
                    found.append(("rank" if name in ("rank", "") else "local", m.group(2)))
                    line = line[m.end():]
                    # torchrun's --tee adds no space, torch's own "[rank0]: " one: indentation in
                    # dumps is even (2, 4, 8 spaces), so an odd run of spaces holds the prefix's own
                    n = len(line) - len(line.lstrip(" "))
                    if n % 2:
                        line = line[1:]
                    continue
                m = _HOST_RANK_RE.match(line)
                if m:
                    found.append(("host", m.group(1)))
                    found.append(("rank", m.group(2)))
                    line = line[m.end():]
                    if m.group(3) == ":" and line[:1] == " " and (len(line) - len(line.lstrip(" "))) % 2:
                        line = line[1:]
                    continue
                m = _MPI_RE.match(line)
                if m:
                    found.append(("rank", m.group(1)))
                    line = line[m.end():]
                    continue
                m = _COLOUR_RE.match(line)
                if m:
                    line = line[m.end():]
                    continue
                m = _KUBECTL_RE.match(line)
                if m:
                    found.append(("host", m.group(1)))
                    line = line[m.end():]
                    continue
                m = _TIME_RE.match(line) or _PID_RE.match(line)
                if m:
                    line = line[m.end():]
                    continue
                break
            if c.isdigit():
                m = _TIME_RE.match(line)
                if m:
                    line = line[m.end():]
                    continue
            if c.isalnum() and "  | " in line[:160]:
                m = _COMPOSE_RE.match(line)
                if m:
                    found.append(("host", m.group(1)))
                    line = line[m.end():]
                    continue
            if c.isdigit():
                break
            if c == "(":
                m = _RAY_RE.match(line)
                if m:
                    if m.group(2):
                        found.append(("host", m.group(2)))
                    line = line[m.end():]
                    continue
                break
            if c == "E" and line.startswith("ESC["):
                m = _COLOUR_RE.match(line)
                if m:
                    line = line[m.end():]
                    continue
            if c in "EWIFD" and line[1:2].isdigit():
                m = _GLOG_PY_RE.match(line)
                if m:
                    line = line[m.end():]
                    continue
            if c in "DIWEC" and line[1:2].isupper():
                m = _LEVEL_RE.match(line)
                if m:
                    line = line[m.end():]
                    continue
            if c == ">":
                m = _QUOTE_RE.match(line)
                line = line[m.end():]  # type: ignore[union-attr]  # always matches a ">"
                continue
            if c == " " and line.lstrip(" ")[:1] == "[":
                # a pasted block indented as a whole: "    [rank7]:[E816 ..."
                rest = line.lstrip(" ")
                if _BRACKET_RANK_RE.match(rest) or _HOST_RANK_RE.match(rest):
                    line = rest
                    continue
            break
        return found, line

    def peel(self, line: str) -> Tuple[Identity, str]:
        """``((host, rank, local_rank), text)`` of one line (no newline)."""
        c = line[:1]
        if c in _PLAIN and not (self.stems or self.pods) and "\r" not in line and "\x1b" not in line and (
                line.lstrip(" ")[:1] != "[" if c == " " else (not c or "  | " not in line[:160])):
            # nothing here can start a prefix (see _peel_known; no label was learnt, and a digit,
            # which may start srun's task id, is no plain start): most lines of most dumps
            return NO_IDENTITY, line
        if "\x1b" in line:
            line = strip_ansi(line)
        found: List[Tuple[str, str]] = []
        for _ in range(2):
            got, line = self._peel_labelled(line, 3)
            found.extend(got)
            cr = line.rfind("\r")
            if cr < 0:
                break
            # a progress bar redrawn with "\r" and never ended: the last redraw is the line
            line = line[cr + 1:]
        if not found:
            return NO_IDENTITY, line
        host = rank = local = task = node = None
        for kind, value in found:
            if kind == "host":
                host = value
            elif kind == "node":
                node = value
            elif kind == "rank":
                rank = _rank(value)
            elif kind == "local":
                local = _rank(value)
            elif kind == "task":
                task = _rank(value)
        if rank is None and local is None and task is not None:
            # srun's task id is the rank only when no inner layer names one
            rank = task
        if host is None and node is not None:
            host = node
        if host is None and rank is None and local is None:
            return NO_IDENTITY, line
        return (host, rank, local), line


def peel_lines(lines: List[str]) -> List[Tuple[Identity, str]]:
    """Peel a whole small text (tests, docs) after learning its labels.

    >>> peel_lines(["[1,2]<stderr>:Traceback (most recent call last):", "> [rank3]: boom"])
    [((None, 2, None), 'Traceback (most recent call last):'), ((None, 3, None), 'boom')]
    """
    p = Peeler()
    p.learn(lines)
    return [p.peel(x) for x in lines]
