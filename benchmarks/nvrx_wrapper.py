"""Run a bug scenario under nvidia-resiliency-ext's fault tolerance: heartbeats, as its docs tell a user.

    ft_launcher --nproc-per-node 4 --ft-initial-rank-heartbeat-timeout 120 --ft-rank-heartbeat-timeout 8 \\
        benchmarks/nvrx_wrapper.py examples/bugs/skip_broadcast.py

nvidia-resiliency-ext's hang detection (``ft_launcher``, one rank monitor a rank) needs the training
script to call its client: ``RankMonitorClient().init_workload_monitoring()`` once, then
``send_heartbeat()`` every iteration (its documented "heartbeat" API; the "sections" API is the
other). The scenarios in ``examples/bugs`` are left as they are: this wrapper connects the client
before the script runs, sends one heartbeat when ``_common.init()`` returns (the process group is
up: the training loop begins) and one at every ``_common.progress()`` (a step is done), by wrapping
those two functions in the shared ``_common`` module the scenarios import. A heartbeat that fails
is printed and ignored: the script's own behaviour is what is measured.
"""

import os
import runpy
import sys

BUGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "bugs")


def main():
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

    client = RankMonitorClient()
    client.init_workload_monitoring()

    def beat():
        try:
            client.send_heartbeat()
        except Exception as e:  # the monitor went away (the launcher is stopping the job)
            print(f"nvrx_wrapper: heartbeat failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    sys.path.insert(0, BUGS)
    import _common

    init, progress = _common.init, _common.progress

    def init_and_beat(*a, **k):
        got = init(*a, **k)
        beat()
        return got

    def progress_and_beat(*a, **k):
        progress(*a, **k)
        beat()

    _common.init, _common.progress = init_and_beat, progress_and_beat
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
