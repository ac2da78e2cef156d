"""The vllm backends without a running vLLM: the config check of ``engine.vllm.python``, the launch
commands, and the /generate translation both ways, held to vLLM's own request classes and argument
parser in vLLM's interpreter (those tests skip, naming ``make vllm-cpu``, where it is not built).

The real server is tests/engines/vllm/test_vllm_server.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rayrl.config import ConfigError, load_config
from rayrl.engines.backends import BACKENDS
from rayrl.engines.http_input import RequestError
from rayrl.engines.vllm.adapter import parse_args
from rayrl.engines.vllm.process import vllm_command
from rayrl.engines.vllm.requests import StreamState, translate_generate
from rayrl.resolve import load_checked
from tests.vllm_support import VLLM_PYTHON, needs_vllm, run_in_vllm


def test_vllm_rows_are_in_the_table():
    assert BACKENDS["vllm"].on_gpu and not BACKENDS["vllm-cpu"].on_gpu
    assert BACKENDS["vllm"].check is BACKENDS["vllm-cpu"].check is not None


def test_a_missing_interpreter_is_one_line_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"^engine\.vllm\.python: .*nope.* is not an executable file"):
        load_checked(None, ["engine.backend=vllm-cpu", f"engine.vllm.python={tmp_path / 'nope'}"])


def test_an_interpreter_without_vllm_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"^engine\.vllm\.python: .*it has no vllm \(make vllm-cpu"):
        load_checked(None, ["engine.backend=vllm-cpu", f"engine.vllm.python={sys.executable}"])


def test_driver_exits_2_on_a_bad_vllm_interpreter_before_ray(tmp_path):
    done = subprocess.run([sys.executable, "driver.py", "engine.backend=vllm-cpu",
                           f"engine.vllm.python={tmp_path / 'missing'}"], capture_output=True, timeout=120)
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert err.startswith("config error: engine.vllm.python:") and "Traceback" not in err


def _cfg(*extra: str):
    return load_config(None, ["engine.backend=vllm-cpu", "engine.dtype=float32", "engine.num_threads=2",
                              "engine.max_batch_size=8", "engine.context_length=2048", *extra]).engine


def test_the_launch_command_runs_the_adapter_from_rayrl_and_vllm_from_its_venv(monkeypatch):
    monkeypatch.setattr("rayrl.engines.backends.vllm._has_vllm", lambda python: "")
    monkeypatch.setattr("os.access", lambda *a: True)
    monkeypatch.setattr("os.path.isfile", lambda p: True)
    cfg = _cfg("engine.vllm.python=/opt/v/bin/python", "engine.extra_args=[--enforce-eager]")
    cmd = BACKENDS["vllm-cpu"].command(cfg, "/m", 8000, python="/r/bin/python", weight_version="3")
    assert cmd[:3] == ["/r/bin/python", "-m", "rayrl.engines.vllm.adapter"]
    args = parse_args(cmd[3:])
    assert (args.vllm_python, args.device, args.port, args.weight_version) == ("/opt/v/bin/python", "cpu", 8000, "3")
    assert args.vllm_args == ["--enforce-eager"] and args.num_threads == 2
    inner = vllm_command(args, 9000)
    assert inner[:3] == ["/opt/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert inner[-1] == "--enforce-eager" and "--enable-sleep-mode" not in inner  # vLLM refuses it on CPU
    gpu = parse_args(BACKENDS["vllm"].command(cfg, "/m", 8000)[3:])
    assert "--enable-sleep-mode" in vllm_command(gpu, 9000)


@needs_vllm
def test_vllms_own_parser_takes_the_command(monkeypatch):
    """vLLM's own server parser and its check (vllm/entrypoints/launchers/api_server/entry.py ``main``:
    ``make_arg_parser``, ``validate_parsed_serve_args``) take every flag the adapter passes, and the values
    land where we mean them."""
    args = parse_args(["--vllm-python", VLLM_PYTHON, "--model-path", "/m", "--port", "1", "--max-batch-size", "8",
                       "--context-length", "2048", "--", "--enforce-eager"])
    argv = vllm_command(args, 9000)[3:]
    got = run_in_vllm(
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "a = make_arg_parser(FlexibleArgumentParser()).parse_args(DATA)\n"
        "validate_parsed_serve_args(a)\n"
        "print(json.dumps({'model': a.model, 'max_num_seqs': a.max_num_seqs, 'max_model_len': a.max_model_len,"
        " 'ext': a.worker_extension_cls, 'wt': str(a.weight_transfer_config), 'lp': a.logprobs_mode,"
        " 'eager': a.enforce_eager}))", argv)
    assert got["model"] == "/m" and got["max_num_seqs"] == 8 and got["max_model_len"] == 2048
    assert got["ext"] == "rayrl.engines.vllm.worker.RayrlWorkerExtension" and "rayrl_shm" in got["wt"]
    assert got["lp"] == "raw_logprobs" and got["eager"] is True


def test_generate_translation_maps_sglangs_names_to_vllms():
    plan = translate_generate({"input_ids": [1, 2, 3], "rid": "r1", "return_logprob": True, "stream": True,
                               "sampling_params": {"max_new_tokens": 5, "temperature": 0.7, "top_k": 20,
                                                   "stop": "</s>", "no_stop_trim": True, "sampling_seed": 4,
                                                   "logit_bias": {"7": 1.5}, "skip_special_tokens": True}})
    sp = plan.request["sampling_params"]
    assert plan.request["token_ids"] == [1, 2, 3] and plan.request["request_id"] == "r1"
    assert sp == {"max_tokens": 5, "temperature": 0.7, "top_k": 20, "stop": ["</s>"], "seed": 4,
                  "include_stop_str_in_output": True, "logit_bias": {7: 1.5}, "skip_special_tokens": True,
                  "logprobs": 0}
    assert plan.request["output_mode"] == "text" and plan.stream


@pytest.mark.parametrize("body, says", [
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, -2]}, "input_ids"),
    ({"input_ids": [1], "sampling_params": {"json_schema": "{}"}}, "json_schema"),
    ({"input_ids": [1], "sampling_params": {"n": 2}}, "sampling_params.n"),
    ({"input_ids": [1], "return_hidden_states": True}, "return_hidden_states"),
    ({"input_ids": [1], "return_logprob": True, "logprob_start_len": 0, "stream": True}, "not streamed"),
])
def test_generate_translation_refuses_what_it_cannot_serve(body, says):
    with pytest.raises(RequestError, match=says):
        translate_generate(body)


def test_prompt_scoring_asks_one_token_and_answers_none():
    plan = translate_generate({"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": 1,
                               "sampling_params": {"max_new_tokens": 0}})
    sp = plan.request["sampling_params"]
    assert sp["max_tokens"] == 1 and sp["prompt_logprobs"] == 0
    answer = plan.whole_answer({"choices": [{"index": 0, "text": "x", "token_ids": [9], "finish_reason": "length",
                                             "logprobs": {"content": [{"token": "x", "logprob": -0.5}]},
                                             "weight_versions": [{"version": "2", "start": 0, "end": 1}]}],
                                "prompt_logprobs": [None, {"6": {"logprob": -1.0}}, {"7": {"logprob": -2.0}}]})
    assert answer["output_ids"] == [] and answer["text"] == ""
    assert answer["meta_info"]["input_token_logprobs"] == [[-1.0, 6, None], [-2.0, 7, None]]


def _chunk(ids, lps, text, finish=None, spans=None, stop=None):
    return {"choices": [{"index": 0, "token_ids": ids, "text": text, "finish_reason": finish, "stop_reason": stop,
                         "logprobs": {"content": [{"token": "t", "logprob": lp} for lp in lps]},
                         "weight_versions": spans}]}


def test_stream_chunks_become_sglangs_cumulative_chunks_with_versions():
    state = StreamState(translate_generate({"input_ids": [1], "rid": "q", "return_logprob": True, "stream": True}))
    first = state.fold(_chunk([10, 11], [-0.1, -0.2], "ab"))
    assert first["output_ids"] == [10, 11] and first["meta_info"]["finish_reason"] is None
    assert state.fold({"choices": [], "usage": {"prompt_tokens": 1}}) is None  # the usage chunk adds nothing
    last = state.fold(_chunk([12], [-0.3], "c", finish="stop", stop="c",
                             spans=[{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]))
    meta = last["meta_info"]
    assert last["output_ids"] == [10, 11, 12] and last["text"] == "abc"
    assert meta["output_token_logprobs"] == [[-0.1, 10, None], [-0.2, 11, None], [-0.3, 12, None]]
    assert meta["finish_reason"] == {"type": "stop", "matched": "c"} and meta["completion_tokens"] == 3
    assert meta["weight_version"] == "4" and meta["output_token_versions"] == ["3", "3", "4"]


def test_an_aborted_stream_is_sglangs_abort_and_one_version_is_no_per_token_list():
    state = StreamState(translate_generate({"input_ids": [1], "rid": "q", "return_logprob": True, "stream": True}))
    out = state.fold(_chunk([5], [-1.0], "z", finish="abort", spans=[{"version": "7", "start": 0, "end": 1}]))
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["weight_version"] == "7" and "output_token_versions" not in out["meta_info"]
    with pytest.raises(RequestError, match="log-probs for"):
        state.fold(_chunk([6, 7], [-1.0], "zz"))  # fewer log-probs than tokens: never passed on


@needs_vllm
def test_the_requests_we_send_are_valid_vllm_generate_requests():
    """Every shape of request the adapter makes is parsed by vLLM's own GenerateRequest (pydantic, with
    SamplingParams), and the values land in SamplingParams as we mean them."""
    bodies = [
        {"input_ids": [1, 2, 3], "rid": "a", "return_logprob": True, "stream": True,
         "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "skip_special_tokens": True}},
        {"input_ids": [4, 5], "rid": "b", "return_logprob": True,
         "sampling_params": {"max_new_tokens": 3, "temperature": 0.5, "top_k": 5, "stop": ["\n"], "sampling_seed": 1,
                             "frequency_penalty": 0.1, "presence_penalty": 0.2, "logit_bias": {"3": -1.0}}},
        {"input_ids": [4, 5, 6], "return_logprob": True, "logprob_start_len": 1,
         "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}},
    ]
    requests = [translate_generate(b).request for b in bodies]
    got = run_in_vllm(
        "from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest\n"
        "out = []\n"
        "for r in DATA:\n"
        "    g = GenerateRequest.model_validate(r)\n"
        "    sp = g.sampling_params\n"
        "    out.append({'max_tokens': sp.max_tokens, 'logprobs': sp.logprobs,"
        " 'prompt_logprobs': sp.prompt_logprobs, 'temperature': sp.temperature, 'top_k': sp.top_k,"
        " 'seed': sp.seed, 'stop': sp.stop, 'logit_bias': {str(k): v for k, v in (sp.logit_bias or {}).items()},"
        " 'id': g.request_id, 'mode': g.output_mode})\n"
        "print(json.dumps(out))", requests)
    assert [g["max_tokens"] for g in got] == [8, 3, 1]
    assert [g["logprobs"] for g in got] == [0, 0, 0] and got[2]["prompt_logprobs"] == 0
    assert got[1]["top_k"] == 5 and got[1]["seed"] == 1 and got[1]["stop"] == ["\n"]
    assert got[1]["logit_bias"] == {"3": -1.0} and got[0]["id"] == "a" and got[0]["mode"] == "text"


def _vllm_source():
    from pathlib import Path

    out = subprocess.run([VLLM_PYTHON, "-c", "import importlib.util as u; "
                          "print(u.find_spec('vllm').submodule_search_locations[0])"],
                         capture_output=True, text=True, timeout=60, check=True)
    return Path(out.stdout.strip())


@needs_vllm
def test_every_vllm_route_and_field_the_adapter_uses_is_in_the_pinned_source():
    """Read from vLLM's own source (no server): each route the adapter calls is registered, with the
    query and body fields the adapter sends, and vLLM's server checks the same list at start."""
    import re

    from rayrl.engines.vllm.process import REQUIRED_ROUTES

    root = _vllm_source() / "entrypoints"
    text = {p: p.read_text() for p in root.rglob("*.py")}
    registered = {m for src in text.values()
                  for m in re.findall(r'(?:@router\.(?:post|get)\(\s*|add_api_route\(\s*)"([^"]+)"', src)}
    assert set(REQUIRED_ROUTES) - {"/health"} <= registered, set(REQUIRED_ROUTES) - registered
    rl = (root / "rl" / "online" / "api_router.py").read_text()
    for field in ('mode: Annotated[PauseMode, Query()]', 'clear_cache: Annotated[bool, Query()]',
                  'init_info: Annotated[dict[str, Any], Body(embed=True)]',
                  'update_info: Annotated[WeightTransferUpdatePayload, Body(embed=True)]',
                  'weight_version: Annotated[str | None, Body(embed=True)]',
                  'new_version: Annotated[str, Body(embed=True)]', 'body.get("request_ids")'):
        assert field in rl, field
    assert 'Literal["abort", "wait", "keep"]' in (_vllm_source() / "v1" / "engine" / "__init__.py").read_text()
    cache = (root / "serve" / "dev" / "cache" / "api_router.py").read_text()
    assert "reset_running_requests: bool = Query(" in cache
    serving = (root / "scale_out" / "token_in_token_out" / "serving.py").read_text()
    assert 'f"generate-tokens-{self._base_request_id(raw_request, request.request_id)}"' in serving  # abort ids


def test_a_llama_class_over_byte_level_bpe_gets_a_generic_tokenizer_for_vllm(smollm2_dir, tmp_path):
    """Our converted SmolLM2 names LlamaTokenizer over a byte-level BPE; vLLM's transformers 5 would decode
    it with SentencePiece's decoder (``TheĠsea``: the real server test caught it). vLLM gets a copy naming
    the generic fast tokenizer; a model whose class is right gets none."""
    import json
    import shutil

    from rayrl.engines.vllm.process import tokenizer_override

    out = tokenizer_override(str(smollm2_dir), tmp_path / "tok")
    assert out is not None
    assert json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "PreTrainedTokenizerFast"
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == (smollm2_dir / "tokenizer.json").read_bytes()
    right = tmp_path / "right"
    shutil.copytree(tmp_path / "tok", right)
    assert tokenizer_override(str(right), tmp_path / "again") is None


def test_a_vllm_that_dies_at_start_says_why_in_one_line(capfd):
    """vLLM's output goes on into the engine's log, and the last error line is what the adapter's exit
    message quotes (a model it cannot load, a flag it refuses), not a bare exit status."""
    from rayrl.engines.vllm.process import VLLMOutput

    script = ("import sys; print('INFO loading'); print('WARNING something odd'); "
              "print('ValueError: No model found at /nowhere/model', flush=True); sys.exit(1)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = VLLMOutput(proc)
    proc.wait(30)
    assert output.why() == ": ValueError: No model found at /nowhere/model"
    assert "INFO loading" in capfd.readouterr().out  # copied through to the log
