"""Bad input and live runs: the inspector's command line, reader and JSON API never answer a traceback."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rayrl.inspect.reader import RunDirError, RunReader

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rayrl.inspect", *args], check=False, cwd=ROOT, capture_output=True,
                          text=True,
                          timeout=120)


@pytest.mark.parametrize("kind", ["missing", "file", "empty"])
def test_not_a_run_directory_is_one_clear_line(tmp_path, kind):
    path = tmp_path / "run"
    if kind == "file":
        path.write_text("hello")
    elif kind == "empty":
        path.mkdir()
    out = _cli(str(path), "--export", str(tmp_path / "x.html"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    expected = {"missing": "no such directory", "file": "is a file", "empty": "does not look like a rayrl run"}[kind]
    assert expected in out.stderr and str(path) in out.stderr
    assert not (tmp_path / "x.html").exists()


def test_partial_and_corrupt_files_become_problems_not_failures(scripted_run, tmp_path):
    src, _ = scripted_run
    run = tmp_path / "damaged"
    shutil.copytree(src, run)
    with (run / "episodes" / "step000002.jsonl").open("a") as fh:
        fh.write('{"session_id": "s0-half", "rew')  # a line still being written
    (run / "inspect" / "step000001.json").write_text('{"format": 1, "episodes": [')  # cut short
    (run / "config.yaml").write_text("exp_id: [unclosed")
    reader = RunReader(run)
    data = reader.read().summary()
    assert len(data["episodes"]) == 7  # every whole line is still there
    problems = "\n".join(data["problems"])
    assert "step000002.jsonl: last line (still being written?) is not valid JSON" in problems
    assert "config.yaml is not valid YAML" in problems
    detail = reader.episode(1, 0)
    assert detail["row"]["task_id"] == "task-tangle" and detail["tree"] is None
    assert "step000001.json is not valid JSON" in detail["problem"]
    assert reader.episode(2, 0)["samples"]  # the other step's detail is untouched
    assert reader.episode(1, 99) is None and reader.episode(7, 0) is None
    # the CLI exports it anyway and says what it wrote
    out = _cli(str(run), "--export", str(tmp_path / "damaged.html"), "--atif", str(tmp_path / "d.json"))
    assert out.returncode == 0, out.stderr
    assert "wrote" in out.stdout and "Traceback" not in out.stderr
    (run / "metrics.jsonl").unlink()
    shutil.rmtree(run / "inspect")
    data = RunReader(run).read().summary()
    assert data["metrics"] == [] and any("metrics.jsonl is missing" in p for p in data["problems"])
    assert RunReader(run).episode(1, 0)["problem"].startswith("no inspection data for this step")


def test_malformed_records_in_valid_json_are_named_not_crashed_on(scripted_run, tmp_path, serve):
    src, _ = scripted_run
    run = tmp_path / "malformed"
    shutil.copytree(src, run)
    path = run / "inspect" / "step000002.json"
    doc = json.loads(path.read_text())
    doc["episodes"][0]["samples"][0]["mask"] = [[1, 1]]  # covers one token, not the response
    doc["episodes"][1]["tree"]["nodes"][2]["parent"] = 99
    doc["episodes"][2]["samples"] = [{"tokens": "not ids"}]
    path.write_text(json.dumps(doc))
    served = serve(run)
    status, body = served.get("api/episode?step=2&index=0")
    assert status == 200 and body["samples"] is None and body["tree"]["nodes"]
    sample = doc["episodes"][0]["samples"][0]
    assert body["problem"] == ("inspect/step000002.json, episode 0: sample 0's mask or versions do not cover its "
                               f"{len(sample['tokens']) - sample['prompt_length']} "
                               "response tokens; not shown")
    status, body = served.get("api/episode?step=2&index=1")
    assert status == 200 and body["tree"] is None and body["samples"]
    assert "node 2 names parent 99" in body["problem"]
    status, body = served.get("api/episode?step=2&index=2")
    assert status == 200 and body["samples"] is None and "sample 0 is malformed" in body["problem"]
    out = _cli(str(run), "--export", str(tmp_path / "m.html"), "--atif", str(tmp_path / "m.json"))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr


def test_api_rejects_bad_input_with_json_4xx(scripted_run, serve):
    run_dir, made = scripted_run
    served = serve(run_dir)
    status, body = served.get("api/run")
    assert status == 200 and body["exp_id"] == "scripted" and body["steps"] == [1, 2] and body["problems"] == []
    assert [m["step"] for m in body["metrics"]] == [1, 2]
    status, body = served.get("api/episode?step=1&index=0")
    assert status == 200 and body["row"]["session_id"] == made["steps"][1][0].session_id
    assert body["tree"]["stats"]["turns"] == 4 and len(body["samples"]) == 3
    assert set(body["vocab"]) == {str(t) for s in body["samples"] for t in s["tokens"]}
    for query, param in (("step=one&index=0", "step"), ("step=1", "index"), ("step=1&index=1.5", "index")):
        status, body = served.get("api/episode?" + query)
        assert status == 400 and body["error"]["param"] == param, query
    status, body = served.get("api/episode?step=1&index=40")
    assert status == 404 and body["error"]["param"] == "index"
    status, body = served.get("api/nothing")
    assert status == 404 and "no route" in body["error"]["message"]
    status, page = served.get("")
    assert status == 200 and "rayrl inspector" in page and 'id="rayrl-data"' not in page  # served: no data block


def test_a_run_in_progress_is_viewable_and_grows(scripted_run, tmp_path, serve):
    src, _ = scripted_run
    run = tmp_path / "live"
    (run / "episodes").mkdir(parents=True)
    shutil.copy(src / "episodes" / "step000001.jsonl", run / "episodes")  # step 1 rolled out, nothing else yet
    served = serve(run)
    status, body = served.get("api/run")
    assert status == 200 and body["steps"] == [1] and len(body["episodes"]) == 4 and body["metrics"] == []
    assert any("config.yaml is missing" in p for p in body["problems"])
    status, body = served.get("api/episode?step=1&index=0")
    assert status == 200 and body["tree"] is None and "no inspection data" in body["problem"]
    # a poll that finds nothing changed is a 304 (the ETag is the reader's stamp of the files)
    etag = _etag(served, "api/run")
    assert etag == f'"{_body_stamp(served)}"' and _status(served, "api/run", {"If-None-Match": etag}) == 304
    for name in ("config.yaml", "metrics.jsonl"):
        shutil.copy(src / name, run / name)
    shutil.copytree(src / "inspect", run / "inspect")
    shutil.copy(src / "episodes" / "step000002.jsonl", run / "episodes")
    assert _status(served, "api/run", {"If-None-Match": etag}) == 200  # the run grew
    status, body = served.get("api/run")
    assert body["steps"] == [1, 2] and len(body["metrics"]) == 2 and body["problems"] == []
    assert f'"{body["stamp"]}"' != etag
    assert served.get("api/episode?step=1&index=0")[1]["tree"]["stats"]["turns"] == 4


def _response(served, path: str, headers: dict[str, str] | None = None):
    request = urllib.request.Request(served.root + path, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.headers
    except urllib.error.HTTPError as err:
        return err.code, err.headers


def _etag(served, path: str) -> str:
    return _response(served, path)[1]["ETag"]


def _status(served, path: str, headers: dict[str, str]) -> int:
    return _response(served, path, headers)[0]


def _body_stamp(served) -> str:
    return served.get("api/run")[1]["stamp"]


def test_beyond_loopback_a_session_token_is_required(scripted_run, serve):
    run_dir, _ = scripted_run
    served = serve(run_dir, host="0.0.0.0")
    assert "?token=" in served.url
    token = served.url.split("?token=")[1]
    status, body = served.get("api/run")
    assert status == 401 and body["error"]["param"] == "token"
    assert served.get("api/run?token=wrong")[0] == 401
    assert served.get(f"api/run?token={token}")[0] == 200
    assert served.get("api/run", headers={"Authorization": f"Bearer {token}"})[0] == 200
    loopback = serve(run_dir)
    assert "token" not in loopback.url and loopback.get("api/run")[0] == 200


def test_reader_errors_name_the_path(tmp_path):
    with pytest.raises(RunDirError, match="no such directory"):
        RunReader(tmp_path / "nope")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward_mean": 0.5}) + "\n")
    data = RunReader(tmp_path).read().summary()  # a run with metrics only: viewable, with its problems said
    assert data["metrics"][0]["rollout/reward_mean"] == 0.5 and data["episodes"] == []


def test_unwritable_output_and_busy_port_are_one_clear_line(scripted_run, tmp_path):
    run_dir, _ = scripted_run
    out = _cli(str(run_dir), "--export", str(tmp_path / "no" / "such" / "dir.html"))
    assert out.returncode == 2 and "cannot write" in out.stderr and "Traceback" not in out.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _cli(str(run_dir), "--port", str(port))
    assert out.returncode == 2 and f"cannot serve on 127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr
