"""One file, read once, line by line: prefixes peeled, blocks to their stack parsers, log lines to
the log readers.

Each line is peeled of its launcher prefixes (:mod:`hangdoc.readers.prefix`); lines of one writer
identity form a *channel* with its own active block parser, so the interleaved output of many
ranks comes apart. A line that no parser claims may start a block (:func:`registry.detect`), be a
``# hangdoc`` tag or exited line, or a ``=== Rank N: addr ===`` section header (torch's debug
server), which gives identity to the un-prefixed lines after it. Lines that hold a log keyword go
to the log readers as well, whatever parser claims them: the exception line of a traceback is
also the watchdog's timeout.

A stretch of 256 KB with no anchor of any format, read while no block is open, is skipped without
being decoded: a gigabyte of training log with a few watchdog lines in it reads at disk speed.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

from hangdoc.model import ROLE_LAUNCHER, ROLE_WORKER, STATUS_LOG, STATUS_OK, STATUS_UNRESPONSIVE, LogEvent, Process, Source, Thread
from hangdoc.readers import c10_backtrace as _c10
from hangdoc.readers import pyspy as _pyspy
from hangdoc.readers import registry
from hangdoc.readers._base import BlockParser, FileContext, Interner, chunks, same_dump, squeeze
from hangdoc.readers.identity import (
    apply_exit_events,
    apply_tags,
    exited_process,
    finish_identity,
    from_file_name,
    tie_workers_by_order,
)
from hangdoc.readers.prefix import NO_IDENTITY, Identity, Peeler
from hangdoc.safeio import open_input
from hangdoc.tags import PREFIX as _TAG_PREFIX
from hangdoc.tags import parse_exited, parse_tag

__all__ = ["read_stream"]

#: bytes read at a time: a stretch this long with no anchor is skipped whole
BLOCK = 1 << 18
#: times one line repeated in a row is shown to the log readers (the stack parsers see every one)
MAX_RUN = 100

_SECTION_RE = re.compile(r"=== Rank (\d{1,9})(?:: ?([^\s=]{0,255}))? ?===\s*$")


class _Channel:
    """The lines of one writer (one rank's output) inside a file, with their own parser."""

    __slots__ = ("parser", "tag_line", "rank", "local_rank", "host", "ident")

    def __init__(self, ident: Identity = NO_IDENTITY) -> None:
        self.parser: Optional[BlockParser] = None
        #: the line of a tag not yet followed by anything (0: none)
        self.tag_line = 0
        self.ident = ident
        self.host, self.rank, self.local_rank = ident


def _section(text: str) -> Optional[Identity]:
    m = _SECTION_RE.match(text)
    if m is None:
        return None
    addr = m.group(2) or ""
    if "://" in addr:  # the debug server names each rank by its worker's URL
        addr = addr.split("://", 1)[1].split("/", 1)[0]
    host = addr.rsplit(":", 1)[0] if ":" in addr else (addr or None)
    if host is not None and host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return (host or None, int(m.group(1)), None)


def read_stream(path: str, source: Source, interner: Interner, fileobj=None,
                head: Optional[bytes] = None) -> Tuple[List[Process], List[LogEvent]]:
    """The processes and log events of one file (identity within the file resolved). ``head``:
    the file's first bytes (at least :data:`LEARN_BYTES` of them, or all), when the caller read them."""
    ctx = FileContext(path, source, interner)
    peeler = Peeler()
    channels: Dict[Identity, _Channel] = {NO_IDENTITY: _Channel()}
    main = channels[NO_IDENTITY]
    emitted: List[Tuple[_Channel, Process]] = []
    tags: List[Tuple[_Channel, int, Dict[str, str]]] = []
    exits: List[Tuple[_Channel, int, Dict[str, str]]] = []
    readers = registry.new_log_readers(ctx)
    # each reader with its own keywords (the same order): a line goes to the readers whose keyword it
    # holds, not to all ten (an 8 MB log of NCCL watchdog lines ran 21 regex searches a line)
    own = list(zip(readers, [tuple(m.KEYWORDS) for m in registry.log_modules()]))  # type: ignore[attr-defined]
    kw = registry.keyword_re().search
    has_anchor = registry.has_anchor
    has_keyword = registry.has_keyword
    last_of: Dict[int, Process] = {}  # id(channel) -> its last process (a c10 backtrace joins it)
    last_any: List[Process] = []  # the file's last process (C++ prints its backtraces unprefixed)
    # C++ backtraces with no process before them: kept only when the file holds nothing else (they
    # are a watchdog thread's, not a process of their own)
    orphans: List[Tuple[_Channel, Process]] = []
    tag_at: Dict[int, int] = {}  # id(channel) -> the line of its last tag (a tagged dump is never folded)
    repeats: Dict[int, int] = {}  # id(process) -> the dumps read as a repeat of it (see same_dump)

    # what the last close() did: (processes emitted, the process its dumps were folded into, the
    # line its block started at)
    closed: List = [0, None, 0]

    def close(ch: _Channel) -> None:
        parser, ch.parser = ch.parser, None
        closed[0], closed[1] = 0, None
        if parser is None:
            return
        closed[2] = parser.start
        try:
            procs = parser.close()
        except Exception as e:  # a reader bug must cost one block, never the whole input
            ctx.error(parser.start, f"could not read this {parser.format} block: {type(e).__name__}: {e}")
            return
        for p in procs:
            prev = last_of.get(id(ch)) or (last_any[-1] if last_any else None)
            if p.format == _c10.FORMAT and prev is not None and prev.format != _c10.FORMAT:
                for t in p.threads:
                    prev.threads.append(Thread(ident=t.ident, name=t.name, frames=t.frames, is_main=False))
                if p.meta.get("raised_from"):
                    prev.meta.setdefault("raised_from", p.meta["raised_from"])
                continue
            if p.format == _c10.FORMAT:
                orphans.append((ch, p))
                continue
            again = parser.repeats.get(id(p), 0)  # its repeats inside the block
            if prev is not None and prev is last_of.get(id(ch)) and tag_at.get(id(ch), 0) < prev.source_line \
                    and same_dump(prev, p):
                # the same dump again, right after it (py-spy or faulthandler dumping one process in a
                # loop into one log): one process, its latest dump; counted, and said once below
                prev.source_line = max(prev.source_line, p.source_line)
                repeats[id(prev)] = repeats.get(id(prev), 0) + 1 + again
                closed[1] = prev
                continue
            if again:
                repeats[id(p)] = again
            closed[0] += 1
            emitted.append((ch, p))
            last_of[id(ch)] = p
            last_any[:] = [p]

    def idle(data: bytes) -> bool:
        """Skip a stretch: no block open, no reader inside a block, no marker in it."""
        if any(ch.parser is not None for ch in channels.values()) or any(r.active for r in readers):
            return False
        return not has_anchor(data)

    last = 0
    tag_start = _TAG_PREFIX.strip()
    # Fast path: frame lines of the main channel (nearly every line of a dump) go straight to its
    # parser's sink; msink/mindent mirror main.parser's and are refreshed after any other line.
    msink: Optional[List[str]] = None
    mindent = "\x00"
    touched: Set[_Channel] = set()  # channels with lines in the current chunk
    same: Optional[str] = None  # the last line, when reading it changed nothing
    peeled_line: Optional[str] = None  # the last line peeled, and what peeling it gave
    peeled: Tuple[Identity, str] = (NO_IDENTITY, "")
    kw_text: Optional[str] = None  # the last text looked up for keywords, and which readers' it holds
    kw_of: Optional[list] = None
    # the readers inside a block (active), in the readers' order: only a reader that was fed a line
    # can have changed it, so it is worked out again only after one was
    actives: list = [r for r in readers if r.active]
    idle_text: Optional[str] = None  # the last text dispatched that started nothing
    # A line that closed a block of one line, the same line right before it, as a repeat of the dump
    # before it and started the same block again, or that its parser counted as one more repeat (a
    # dump header repeated: 8 MB of one thread line): the same line next, the block as it was, would
    # do exactly that again, and is counted as one more repeat without being read again.
    rep_line: Optional[str] = None
    run_line: Optional[str] = None  # the line of the current run of equal lines, its length, its last line
    run = run_at = 0
    last_disp: Tuple[int, Optional[str]] = (0, None)  # the last line dispatched
    rep_parser: Optional[BlockParser] = None
    rep_sink = 0
    rep_of: Optional[Process] = None
    peeler.learn(_head_lines(path, fileobj, head))
    for first, block in chunks(path, ctx, fileobj, skip=idle, size=BLOCK):
        lineno = first - 1
        cut = ctx.cut_off  # set with the file's last block when its last line has no newline
        for line in block:
            lineno += 1
            if lineno == cut:
                # a line cut short is no frame: a stack block open in its channel ends before it
                # (the file is what was cut, not the process: the source is marked truncated below)
                ident, text = peeler.peel(line)
                ch = channels.get(ident) if ident != NO_IDENTITY else main
                if ch is not None and ch.parser is not None:
                    if readers and kw(text) is not None:
                        for r in readers:
                            try:
                                r.feed(lineno, text, ch.ident)
                            except Exception as e:
                                ctx.error(lineno, f"could not read this line ({r.format}): {type(e).__name__}: {e}")
                        actives = [r for r in readers if r.active]
                    continue
            if msink is not None and line.startswith(mindent):
                msink.append(line)
                continue
            if line == same:
                continue
            if line == peeled_line:  # peeling is a pure function of the line: a repeat is peeled once
                ident, text = peeled
            else:
                ident, text = peeled = peeler.peel(line)
                peeled_line = line
            if ident is NO_IDENTITY or ident == NO_IDENTITY:
                ch = main
                if text[:4] == "=== ":
                    sec = _section(text)
                    if sec is not None:
                        close(main)
                        main = channels.get(sec) or channels.setdefault(sec, _Channel(sec))
                        msink = None
                        continue
            else:
                ch = channels.get(ident)
                if ch is None:
                    ch = channels[ident] = _Channel(ident)
                touched.add(ch)
            fed = readers
            if line == run_line and lineno == run_at + 1:
                run += 1
            else:
                run_line, run = line, 1
            run_at = lineno
            if run > MAX_RUN:
                # the readers have seen this line MAX_RUN times in a row: a log stuck printing one
                # line says nothing new to them (their events are kept once; a table or a stack they
                # read in it stays as it was), and 8 MB of one "Failures:" line took 3 s
                fed = []
            elif readers:
                # a line with no reader's keyword is only for the readers inside a block (the
                # contract of _logbase); the others are not called: a 190,000-line stack inside an
                # fr_trace block went through all ten readers
                if text != kw_text:
                    # which readers' keywords a text holds, looked up once for a run of equal texts
                    kw_text = text
                    kw_of = None
                    if has_keyword(text):
                        kw_of = [r for r, words in own if any(w in text for w in words)]
                if kw_of is not None:
                    if not actives:
                        fed = kw_of
                    elif all(r in actives for r in kw_of):
                        fed = actives
                    else:
                        fed = [r for r in readers if r in kw_of or r in actives]
                else:
                    fed = actives
                for r in fed:
                    try:
                        r.feed(lineno, text, ch.ident)
                    except Exception as e:  # one reader's bug costs its line, not the file
                        ctx.error(lineno, f"could not read this line ({r.format}): {type(e).__name__}: {e}")
                if fed is not actives:
                    # only a reader fed can have changed (a line for one inactive reader that left it
                    # so changes nothing)
                    if actives or any(r.active for r in fed):
                        actives = [r for r in readers if r.active]
                elif fed and not all(r.active for r in fed):
                    actives = [r for r in fed if r.active]
            if text == idle_text and ch.parser is None and not ch.tag_line:
                # this text, in a channel with no block and no tag before it, started nothing the
                # last time (detection is a pure function of the text): the readers' lines of an
                # 8 MB log of one exception line are not each detected again
                same = line if not fed else None
                continue
            if line == rep_line and ch.parser is rep_parser and \
                    (rep_parser.sink is None or len(rep_parser.sink) == rep_sink):
                if rep_of is not None:
                    rep_of.source_line = lineno
                    repeats[id(rep_of)] += 1
                else:
                    rep_parser.repeat_again(lineno)
                continue
            was_open, ntags, nexits = ch.parser is not None, len(tags), len(exits)
            closed[0], closed[1] = 0, None
            _dispatch(ctx, ch, lineno, text, close, tags, tag_start, exits)
            if len(tags) != ntags:
                tag_at[id(ch)] = lineno
            rep_line = None
            if closed[1] is not None and not closed[0] and ch.parser is not None and ch.parser.start == lineno \
                    and closed[2] == lineno - 1 and last_disp == (lineno - 1, line):
                rep_line, rep_parser, rep_of = line, ch.parser, closed[1]
                rep_sink = len(rep_parser.sink) if rep_parser.sink is not None else 0
            elif ch.parser is not None and ch.parser.repeated_at == lineno:
                # the parser read this line as one more repeat of the dump before (see
                # BlockParser.repeat), its state unchanged: the same line next is one more
                rep_line, rep_parser, rep_of = line, ch.parser, None
                rep_sink = len(rep_parser.sink) if rep_parser.sink is not None else 0
            last_disp = (lineno, line)
            idle_text = text if (not was_open and ch.parser is None and not ch.tag_line and len(tags) == ntags
                                 and len(exits) == nexits) else None
            # a line that changed nothing (no reader, no block, no tag) changes nothing when it
            # comes again right after: 200,000 copies of one line are read once
            same = line if (not fed and idle_text is not None) else None
            mp = main.parser
            if mp is not None and mp.sink is not None:
                msink, mindent = mp.sink, mp.indent
            else:
                msink = None
        last = lineno
        touched.add(main)
        _squeeze_sinks(touched)
        touched.clear()
    for ch in list(channels.values()):
        close(ch)
    if repeats:
        n = sum(repeats.values())
        for _, p in emitted:
            if id(p) in repeats:
                p.meta["snapshots"] = 1 + repeats[id(p)]
        ctx.error(0, f"{n} dump{'s' if n > 1 else ''} repeated the dump right before {'them' if n > 1 else 'it'} "
                     "(the same process, threads and stacks): read as that process dumped again, the last kept")
    if orphans and not emitted and not any(r.events for r in readers):
        emitted.extend(orphans)
    events: List[LogEvent] = []
    for r in readers:
        try:
            events.extend(r.close())
        except Exception as e:
            ctx.error(0, f"could not finish reading ({r.format}): {type(e).__name__}: {e}")
    if ctx.cut_off and ctx.cut_off == last:
        source.truncated = True
        ctx.error(last, "file ends in the middle of a line (cut off?)")
        if emitted:
            # a file cut short (a paste, a copy, a full disk) says nothing about the process whose
            # dump it ends in: the source is truncated, the process keeps what was read of it
            lastp = max((p for _, p in emitted), key=lambda p: p.source_line)
            lastp.meta["cut_off"] = "the file ends in the middle of this dump"
            if (not any(t.frames for t in lastp.threads) and lastp.status in (STATUS_OK, STATUS_UNRESPONSIVE)
                    and "error" not in lastp.meta):
                # its header was read, the file ends before its stack: no stack was read, and the
                # dumper never said it could not take one
                lastp.status = STATUS_LOG
                lastp.status_detail = "the file ends before its stack (truncated)"

    for ch, lineno, fields in exits:
        # a DataLoader worker or a launcher that exits is no news (workers come and go): only ranks
        if fields.get("role") not in (ROLE_WORKER, ROLE_LAUNCHER):
            emitted.append((ch, exited_process(ctx, lineno, fields)))
    emitted.sort(key=lambda cp: cp[1].source_line)
    apply_tags(emitted, tags)
    apply_exit_events(emitted, events)
    procs: List[Process] = []
    for ch, p in emitted:
        if p.host is None:
            p.host = ch.host
        if p.rank is None and ch.rank is not None:
            p.rank = ch.rank
            p.meta.setdefault("rank_from", "prefix")
        if p.local_rank is None and ch.local_rank is not None:
            p.local_rank = ch.local_rank
        ctx.add(p)
        procs.append(p)
    from_file_name(ctx, procs)
    for p in procs:
        finish_identity(p, interner)
    tie_workers_by_order(procs)
    events.extend(_exceptions(procs, events))
    # the ranks the events hold, counted as they change (the set was built again for every event:
    # an 8 MB log of one exception line took 60 s)
    ranks = Counter(x.rank for x in events)
    for e in events:
        if e.host is None:
            e.host = ctx.host_from_name
        if e.rank is None and ctx.rank_from_name is not None and len(ranks) <= 1:
            e.rank = ctx.rank_from_name
            ranks[None] -= 1
            if not ranks[None]:
                del ranks[None]
            ranks[e.rank] += 1
    # the event lines read, as before a line repeated right after itself became one event (emit)
    source.events = len(events) + sum(r.emitted - len(r.events) for r in readers)
    for r in readers:
        if r.events and r.format not in source.formats:
            source.formats.append(r.format)
    ctx.finish()
    return procs, events


def _squeeze_sinks(channels: Iterable[_Channel]) -> None:
    """Keep a runaway stack's raw lines bounded while it is read (its middle goes, see _base.squeeze):
    called once a chunk with the channels that had lines in it."""
    for ch in channels:
        sink = ch.parser.sink if ch.parser is not None else None
        if sink is not None and len(sink) >= 128:
            squeeze(sink)


#: bytes of a file's head its prefixes are learnt from
LEARN_BYTES = 1 << 16


def _head_lines(path: str, fileobj=None, head: Optional[bytes] = None) -> List[str]:
    """The first lines of a file (for :meth:`Peeler.learn`), the file left where it was."""
    try:
        if head is not None:
            data = head[:LEARN_BYTES]
        elif fileobj is not None:
            pos = fileobj.tell()
            data = fileobj.read(LEARN_BYTES)
            fileobj.seek(pos)
        else:
            with open_input(path) as f:
                data = f.read(LEARN_BYTES)
    except (OSError, ValueError):
        return []
    return data.decode("utf-8", "replace").split("\n")[:-1] or [data.decode("utf-8", "replace")]


def _exceptions(procs: List[Process], events: List[LogEvent]) -> List[LogEvent]:
    """An ``exception`` event for every traceback a rank printed (its last frame is where)."""
    out = []
    for p in procs:
        exc = p.meta.get("exception")
        if not exc or p.role in (ROLE_WORKER, ROLE_LAUNCHER) or p.format not in ("traceback",):
            continue
        main = p.main_thread
        top = main.top if main is not None else None
        at = f"{top.file}:{top.line}" if top is not None and top.line is not None else None
        out.append(LogEvent(kind="exception", source=p.source, line=p.source_line, host=p.host, rank=p.rank,
                            pid=p.pid, fields={"exc": exc, "at": at, "function": top.function if top else None},
                            text=str(exc)[:300]))
    return out


def _dispatch(ctx: FileContext, ch: _Channel, lineno: int, text: str, close: Callable[[_Channel], None],
              tags: List[Tuple[_Channel, int, Dict[str, str]]], tag_start: str,
              exits: List[Tuple[_Channel, int, Dict[str, str]]]) -> None:
    """One line of one channel: to its active parser, or the start of a block, a tag, or nothing."""
    parser = ch.parser
    if parser is not None:
        sink = parser.sink
        if sink is not None and text.startswith(parser.indent):
            sink.append(text)
            return
        try:
            if parser.feed(lineno, text):
                return
        except Exception as e:
            ctx.error(lineno, f"could not read this line: {type(e).__name__}: {e}")
            return
        close(ch)
    if text[:1] == "#":
        if text.startswith(tag_start):
            # the fields of one tag text are parsed once and shared (read only): 8 MB of a repeated
            # tag line held 118,000 dicts, 93 MB
            cache = ctx.interner.tags
            fields = cache.get(text)
            if fields is None:
                fields = parse_tag(text)
                if fields is not None and len(cache) < 65536:
                    cache[text] = fields
            if fields is not None:
                tags.append((ch, lineno, fields))
                ch.tag_line = lineno
            return
        fields = parse_exited(text)
        if fields is not None:
            exits.append((ch, lineno, fields))
            return
    if ch.tag_line and text.startswith("Error: "):
        # right after a tag line, any "Error: ..." is the dumper's (hangdoc dump writes the
        # reasons no dumper could read the process this way)
        new: Optional[BlockParser] = _pyspy.PySpyParser(ctx, lineno, after_tag=True)
    else:
        new = registry.detect(ctx, lineno, text)
    if new is not None or text.strip():
        ch.tag_line = 0
    if new is not None:
        new.feed(lineno, text)
        ch.parser = new
