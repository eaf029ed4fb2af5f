"""The client as a service uses it: batches over two real workers, a worker lost or frozen mid-batch,
resuming, and bad input ending in one line and its exit status."""

import json
import os
import signal
import threading
import time
import urllib.request

import pytest
import tome_client

from tome_harness.comfyui import ROOT
from tome_harness.server import free_port, running_server, server_process

WORKFLOWS = ROOT / "workflows"
API = WORKFLOWS / "api" / "sd15_tome.json"
CHECKPOINTS = ROOT / ".cache" / "checkpoints"
SMALL = ["--width", "64", "--height", "64", "--steps", "2"]


@pytest.fixture(scope="module")
def second_server(checkpoint, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("second_server"), CHECKPOINTS) as url:
        yield url


def _manifest(out):
    return [json.loads(line) for line in (out / tome_client.MANIFEST).read_text().splitlines()]


def _get_json(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def _assert_complete(out, seeds):
    """Every seed done exactly once, each with its images saved under ``out``."""
    records = _manifest(out)
    assert sorted(record["seed"] for record in records) == sorted(seeds)
    for record in records:
        assert record["images"] and all((out / image).stat().st_size > 0 for image in record["images"])
        assert record["seconds"] > 0 and record["prompt"]
    return records


def test_a_batch_of_seeds_spreads_over_two_workers_and_a_rerun_skips_it(server, second_server, tmp_path, capsys):
    command = [str(API), "--server", server, "--server", second_server, "--out", str(tmp_path), "--seeds", "1-6",
               *SMALL]
    assert tome_client.main(command) == 0, capsys.readouterr().err
    records = _assert_complete(tmp_path, range(1, 7))
    assert {record["server"] for record in records} == {server, second_server}
    assert "6 jobs done, 6 images" in capsys.readouterr().out

    assert tome_client.main(command) == 0
    assert "skipping 6 of 6 jobs" in capsys.readouterr().out
    assert len(_manifest(tmp_path)) == 6


def test_prompts_and_seeds_make_every_pair(server, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red lighthouse\n\na blue lighthouse\n")
    status = tome_client.main([str(API), "--server", server, "--out", str(tmp_path / "out"), "--seeds", "1-2",
                               "--prompts", str(prompts), *SMALL])
    assert status == 0, capsys.readouterr().err
    records = _assert_complete(tmp_path / "out", [1, 1, 2, 2])
    assert sorted((r["prompt"], r["seed"]) for r in records) == [
        ("a blue lighthouse", 1), ("a blue lighthouse", 2), ("a red lighthouse", 1), ("a red lighthouse", 2)]


def test_ab_runs_per_job_and_records_both_times(server, tmp_path, capsys):
    status = tome_client.main([str(API), "--server", server, "--out", str(tmp_path), "--seeds", "1-2", "--ab",
                               *SMALL])
    out = capsys.readouterr().out
    assert status == 0
    assert out.count("| without ToMe |") == 2 and out.count("PSNR") == 2
    for record in _assert_complete(tmp_path, [1, 2]):
        assert record["baseline_seconds"] > 0 and record["speedup"] > 0
        assert (tmp_path / record["baseline_images"][0]).exists()
        assert record["images"][0].startswith("with_tome/")


LOSS_SEEDS = range(1, 7)  # six jobs over two workers: the lost worker has done one and runs another


def _start_batch(out, server, lost) -> tuple[threading.Thread, dict]:
    """The client run in a thread over ``server`` and ``lost``; its exit status lands in the dict under
    "status"."""
    command = [str(API), "--server", server, "--server", lost, "--out", str(out),
               "--seeds", f"{LOSS_SEEDS[0]}-{LOSS_SEEDS[-1]}", "--width", "64", "--height", "64", "--steps", "4"]
    result = {}
    client = threading.Thread(target=lambda: result.setdefault("status", tome_client.main(command)))
    client.start()
    return client, result


def _wait_for_second_job(out, url):
    """Until the worker at ``url`` runs its second job: the first (model loading) shows it works, the second
    is the one a test loses."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        manifest = out / tome_client.MANIFEST
        done_there = manifest.exists() and any(r["server"] == url for r in _manifest(out))
        if done_there and _get_json(f"{url}/queue")["queue_running"]:
            return
        time.sleep(0.05)
    pytest.fail(f"the worker at {url} never started a second job")


def _assert_lost_job_done_by(server, lost, out, result, capsys):
    """The batch ended well, every seed done once, and the one job lost with ``lost`` done by ``server``."""
    assert result.get("status") == 0, capsys.readouterr().err
    records = _assert_complete(out, LOSS_SEEDS)
    err = capsys.readouterr().err
    assert f"{lost} stopped answering" in err and "goes back to the queue" in err
    requeued = [record for record in records if record["attempts"] == 2]
    assert len(requeued) == 1 and requeued[0]["server"] == server


def test_a_worker_stopped_mid_batch_has_its_job_done_by_the_other(server, checkpoint, tmp_path_factory, capsys):
    out = tmp_path_factory.mktemp("out")
    with running_server(tmp_path_factory.mktemp("doomed"), CHECKPOINTS) as doomed:
        client, result = _start_batch(out, server, doomed)
        _wait_for_second_job(out, doomed)
    client.join(timeout=300)
    _assert_lost_job_done_by(server, doomed, out, result, capsys)


def test_a_worker_frozen_mid_job_is_dropped_and_its_job_done_by_the_other(server, checkpoint, tmp_path_factory,
                                                                          capsys, monkeypatch):
    # A frozen worker (its process stopped, as a hung machine or a swapping one) keeps its sockets open and
    # answers nothing: no connection error ever comes, only the websocket's heartbeat notices. A shorter
    # heartbeat than the client's 30 s keeps the test short; a pong still has 5 s on a busy CI machine.
    monkeypatch.setattr(tome_client, "HEARTBEAT_S", 10)
    out = tmp_path_factory.mktemp("out")
    with server_process(tmp_path_factory.mktemp("frozen"), CHECKPOINTS) as (frozen, process):
        client, result = _start_batch(out, server, frozen)
        _wait_for_second_job(out, frozen)
        os.kill(process.pid, signal.SIGSTOP)
        try:
            client.join(timeout=300)
        finally:
            os.kill(process.pid, signal.SIGCONT)  # so that it stops when asked
    _assert_lost_job_done_by(server, frozen, out, result, capsys)


def _bad_files(tmp_path):
    (tmp_path / "broken.json").write_text('{"1": {"class_type": ')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "empty.txt").write_text("\n\n")
    return tmp_path


# (arguments after the workflow, workflow, what the one-line message must say)
LOCAL_BAD_INPUT = [
    ([], "{tmp}/missing.json", "workflow file {tmp}/missing.json not found"),
    ([], "{tmp}/broken.json", "is not valid JSON (Expecting value, line 1 column 22)"),
    (["--width", "100"], str(API), "argument --width: 100 is not a positive multiple of 8: use 96 or 104"),
    (["--height", "0"], str(API), "argument --height: 0 is not a positive multiple of 8: use 8 or 16"),
    (["--seeds", "9-3"], str(API), "argument --seeds: '9-3' is empty"),
    (["--seeds", "one"], str(API), "argument --seeds: 'one' is not a seed range: write A-B"),
    (["--seed", "1", "--seeds", "1-2"], str(API), "argument --seeds: not allowed with argument --seed"),
    (["--prompts", "{tmp}/none.txt"], str(API), "--prompts file {tmp}/none.txt not found"),
    (["--prompts", "{tmp}/empty.txt"], str(API), "--prompts file {tmp}/empty.txt has no prompt"),
    (["--steps", "many"], str(API), "argument --steps: invalid int value: 'many'"),
]


@pytest.mark.parametrize("args, workflow, message", LOCAL_BAD_INPUT)
def test_bad_input_found_before_any_server_is_one_line_and_exit_5(tmp_path, capsys, args, workflow, message):
    tmp = _bad_files(tmp_path)
    unreachable = f"http://127.0.0.1:{free_port()}"
    argv = [workflow.format(tmp=tmp), "--server", unreachable, "--out", str(tmp), *(a.format(tmp=tmp) for a in args)]
    assert tome_client.main(argv) == tome_client.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message.format(tmp=tmp) in err
    assert err.count("\n") == 1, err


SERVER_BAD_INPUT = [
    (["--ratio", "1.5"], "sd15_tome.json", "--ratio 1.5 is out of range for ApplyToMe.ratio: use a value from 0.0 to "
                                           "0.99"),
    (["--ratio", "0.5"], "sd15_todo.json", "--ratio sets ratio on ApplyToMe or ApplyToMeAdvanced nodes, and"),
    (["--steps", "0"], "sd15_tome.json", "--steps 0 is out of range for KSampler.steps: use a value from 1 to 10000"),
    (["--width", "16392"], "sd15_tome.json", "--width 16392 is out of range for EmptyLatentImage.width"),
    (["--seeds", "0-18446744073709551616"], "sd15_tome.json", "--seeds 18446744073709551616 is out of range"),
    (["--ab"], "{tmp}/plain.json", "--ab compares the graph with and without its ApplyToDo, ApplyToMe"),
    (["--prompt", "x"], "{tmp}/plain.json", "--prompt sets the text of the CLIPTextEncode feeding a KSampler's"),
    ([], "{tmp}/list.json", "is neither an API-format workflow"),
]


@pytest.mark.parametrize("args, workflow, message", SERVER_BAD_INPUT)
def test_bad_input_found_with_the_servers_node_list_is_one_line_and_exit_5(server, tmp_path, capsys, args,
                                                                            workflow, message):
    tmp = _bad_files(tmp_path)
    plain = {"1": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0}}}
    (tmp / "plain.json").write_text(json.dumps(plain))
    path = workflow.format(tmp=tmp) if "{tmp}" in workflow else str(WORKFLOWS / "api" / workflow)
    assert tome_client.main([path, "--server", server, "--out", str(tmp), *args]) == tome_client.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert err.count("\n") == 1, err


def test_every_option_has_help_text():
    parser = tome_client.build_parser()
    assert all(action.help for action in parser._actions), [a.dest for a in parser._actions if not a.help]


def test_a_manifest_line_cut_short_by_a_crash_is_ignored_and_the_next_record_starts_a_fresh_line(tmp_path):
    manifest = tome_client.Manifest(tmp_path)
    manifest.append({"key": "done"})
    with manifest.path.open("a") as file:
        file.write('{"key": "cut sh')
    manifest.append({"key": "next"})
    assert manifest.done_keys() == {"done", "next"}
    assert manifest.path.read_text().splitlines()[-1] == '{"key": "next"}'
