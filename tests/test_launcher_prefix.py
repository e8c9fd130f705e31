"""hangdoc's output prefix under torchrun adds only what torchrun's own prefixes lack, and
torchrun's failure table shows the script's traceback, on real 2-rank gloo jobs."""

import os
import re
import subprocess
import sys

from hangdoc.runtime import launcher_prefix
from tests.procs import ROOT, run, spawn, kill_group, torchrun_cmd

SCRIPT = os.path.join(ROOT, "tests", "fixtures", "launcher", "failing_script.py")


def test_missing_parts_by_template_and_nodes():
    one, two = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert launcher_prefix.missing_template("[${role_name}${local_rank}]:", one) == ""
    assert launcher_prefix.missing_template("[${role_name}${local_rank}]:", two) == "[{host}:{rank}] "
    assert launcher_prefix.missing_template("[${rank}]:", two) == "[{host}] "
    assert launcher_prefix.missing_template("[${role_name}]:", one) == "[{host}:{rank}] "


def _in_child(tmp_path, redirect_fds, extra_env, expression="choose((1, 2))"):
    """repr(expression) in a process whose fds in ``redirect_fds`` go to torchelastic-style log files."""
    rank_dir = tmp_path / "run_x" / "attempt_0" / "1"
    rank_dir.mkdir(parents=True, exist_ok=True)
    r, w = os.pipe()
    code = ("import os, sys\n"
            "from hangdoc.runtime.launcher_prefix import choose\n"
            f"for fd in {tuple(redirect_fds)!r}:\n"
            "    name = {1: 'stdout.log', 2: 'stderr.log'}[fd]\n"
            f"    f = os.open(os.path.join({str(rank_dir)!r}, name), os.O_WRONLY | os.O_CREAT, 0o600)\n"
            "    os.dup2(f, fd)\n"
            f"os.write({w}, repr({expression}).encode())\n")
    env = dict(os.environ, TORCHELASTIC_ERROR_FILE=str(rank_dir / "error.json"), PYTHONPATH=ROOT, **extra_env)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, pass_fds=(w,), stdin=subprocess.DEVNULL)
    os.close(w)
    out = os.read(r, 4096).decode()
    os.close(r)
    assert proc.wait(timeout=30) == 0
    return out


def test_choose_leaves_teed_streams_of_one_node_alone(tmp_path):
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert _in_child(tmp_path, (1, 2), env) == "('[{host}:{rank}] ', ())"


def test_choose_prefixes_the_stream_torchrun_does_not(tmp_path):
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert _in_child(tmp_path, (1,), env) == "('[{host}:{rank}] ', (2,))"


def test_choose_adds_host_and_rank_across_nodes(tmp_path):
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert _in_child(tmp_path, (1, 2), env) == "('[{host}:{rank}] ', (1, 2))"


def test_choose_with_a_rank_template_adds_only_the_host(tmp_path):
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
           "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${rank}]:"}
    assert _in_child(tmp_path, (1, 2), env) == "('[{host}] ', (1, 2))"


def _rank1_traceback_lines(output):
    return [line for line in output.splitlines() if "rank 1 gave up" in line or "failing_script.py" in line]


def test_torchrun_tee_and_plain_one_prefix_each_and_the_table_shows_the_script():
    # both jobs at once: each is mostly waiting for torchrun's start-up
    teed = spawn(torchrun_cmd(2, "--tee", "3", "hangdoc", SCRIPT, module=True), stderr=subprocess.STDOUT)
    plain = spawn(torchrun_cmd(2, "hangdoc", SCRIPT, module=True), stderr=subprocess.STDOUT)
    try:
        teed_out, _ = teed.communicate(timeout=90)
        plain_out, _ = plain.communicate(timeout=90)
    finally:
        kill_group(teed)
        kill_group(plain)
    assert teed.returncode == 1 and plain.returncode == 1, teed_out[-3000:] + plain_out[-3000:]
    # torchrun --tee: its "[default1]:" alone (one node: the local rank is the rank)
    assert "[default1]:RuntimeError: rank 1 gave up" in teed_out, teed_out[-4000:]
    assert not re.search(r"\[default\d\]:\[[^\]]*:\d\] ", teed_out), teed_out[-4000:]
    # no --tee: hangdoc's "[host:1] " alone, without torch's "[rank1]: " after it
    assert re.search(r"^\[[^\]]+:1\] RuntimeError: rank 1 gave up$", plain_out, re.M), plain_out[-4000:]
    assert "[rank1]:" not in plain_out and "[rank1]:" not in teed_out
    # get_logger's own [host:rank] tag is left out where a prefix names the rank already
    assert re.search(r"^\[default1\]:\d{4}-\d\d-\d\d [\d:,]+ INFO train: step on rank 1$", teed_out, re.M), teed_out[-3000:]
    assert re.search(r"^\[[^\]]+:1\] \d{4}-\d\d-\d\d [\d:,]+ INFO train: step on rank 1$", plain_out, re.M), plain_out[-3000:]
    # torchrun's failure table: the script's traceback, not "To enable traceback see ..."
    for out in (teed_out, plain_out):
        table = out[out.index("Root Cause (first observed failure):"):]
        assert "failing_script.py\", line 7, in step" in table and "RuntimeError: rank 1 gave up" in table, table
        assert "To enable traceback see" not in table


def test_exchange_messages_drop_their_tag_where_torchrun_names_the_rank(tmp_path):
    one = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    expression = "__import__('hangdoc.runtime.exchange', fromlist=['_prefix'])._prefix(__import__('hangdoc.runtime.identity', fromlist=['identity']).identity())"
    assert _in_child(tmp_path, (1, 2), one, expression) == "''"
    assert re.fullmatch(r"'\[[^\]]+:1\] '", _in_child(tmp_path, (), one, expression))
