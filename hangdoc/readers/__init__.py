"""Readers: stack dumps, collective records and console logs of a hung job → one :class:`~hangdoc.model.Job`.

:func:`read_paths` takes files, globs and directories (walked recursively), detects the format of
every block of every file (several formats may share a file: ``srun --output=trace-%N.out``
appends whatever each dumper printed), and fills ``Job.processes``, ``Job.records``, ``Job.events``,
``Job.sources`` (each with its :class:`~hangdoc.model.ParseError` list) and ``Job.world_size``.

The layers, one module each: :mod:`~hangdoc.readers.files` (which files, globs, directories),
:mod:`~hangdoc.readers.stream` (one file line by line), :mod:`~hangdoc.readers.prefix` (launcher
prefixes peeled off every line), :mod:`~hangdoc.readers.registry` (which formats exist),
:mod:`~hangdoc.readers.identity` (who a process is, within a file) and
:mod:`~hangdoc.readers.merge` (across files: the rank map, duplicates, log events joined).

Stack formats, one module each: :mod:`~hangdoc.readers.pyspy` (plain, ``--native``, ``--locals``,
``--json``, py-spy's own errors), :mod:`~hangdoc.readers.faulthandler`,
:mod:`~hangdoc.readers.traceback`, :mod:`~hangdoc.readers.pystack`, :mod:`~hangdoc.readers.gdb`.
Log formats, one ``*_log`` module each (found by name): :mod:`~hangdoc.readers.nccl_log` (the NCCL
watchdog), :mod:`~hangdoc.readers.gloo_log`, :mod:`~hangdoc.readers.detail_log`
(``TORCH_DISTRIBUTED_DEBUG=DETAIL``), :mod:`~hangdoc.readers.elastic_log` (torchrun's failure
table). Record files go to ``records`` and ``flight_recorder``. See ``docs/formats.md``.

Who a process is (host, pid, rank, role) is put together from every piece of evidence there is:
the ``# hangdoc process`` tag line before a dump (:mod:`hangdoc.tags`), a line prefix (``[rank3]:``,
``[default3]:`` from torchrun ``--tee``, ``[host:3]`` from hangdoc), the file name
(``trace-node7.out`` → host ``node7``; ``stacks-node7-r3-42.txt``; ``stderr-rank3.log``), a
``rank`` argument or local in a py-spy ``--locals`` dump, and the rank map (``{"host:pid": rank}``
or ``{"pid": rank}``), which wins. A process whose main thread runs ``_worker_loop`` is a
DataLoader worker, tied to its rank through its parent pid (tag, ``py-spy --subprocesses``) or
through the file it is in; torchrun and the elastic agent are launchers.

    >>> job = read_text('''# hangdoc process host=n1 pid=42 rank=3 world_size=4
    ... Process 42: python train.py
    ... Python v3.11.7 (/usr/bin/python3.11)
    ...
    ... Thread 42 (idle): "MainThread"
    ...     all_reduce (torch/distributed/distributed_c10d.py:3252)
    ...     main (train.py:40)
    ... ''')
    >>> p = job.processes[0]
    >>> (p.host, p.pid, p.rank, p.role, job.world_size, p.main_thread.top.function)
    ('n1', 42, 3, 'rank', 4, 'all_reduce')
"""

from __future__ import annotations

from hangdoc.readers._base import Interner
from hangdoc.readers.files import expand_paths, gc_paused, read_file, read_files, read_paths, read_text
from hangdoc.readers.merge import finish_job, load_rank_map, normalize_rank_map

__all__ = [
    "read_paths", "read_files", "read_file", "read_text", "expand_paths", "finish_job", "load_rank_map",
    "normalize_rank_map", "gc_paused", "Interner",
]
