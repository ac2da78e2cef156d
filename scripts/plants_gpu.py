"""The GPU-path plants for scripts/mutation_check.py (``--set gpu``): known-wrong SGLang calls, schedule
phases, memory-saver and Megatron calls, each with the tests that must fail once it is planted.

Fast tests are the stand-in, contract and phase tests (seconds to a minute); slow tests are the
whole-pipeline runs (``--slow``, minutes each). docs/gpu.md says what each plant stands for.
"""

from __future__ import annotations

from scripts.mutation_check import Plant

STANDIN = "tests/engines/cpu/test_sglang_standin.py"
PHASES = "tests/orchestration/test_schedule_phases.py"
SCHEDULES = "tests/pipeline/test_schedules_e2e.py"
CLIENT_CONTRACT = "tests/contracts/test_sglang_contract.py"
COLOCATED = f"{SCHEDULES}::test_colocated_async_two_steps_pauses_engines_in_order"

PLANTS = (
    Plant("dtype-names", "rayrl/weights/group.py",
          'return str(dtype).removeprefix("torch.")', "return str(dtype)",
          'dtypes sent as "torch.bfloat16": SGLang resolves getattr(torch, dtype)',
          fast=(f"{STANDIN}::test_the_broadcast_sender_sends_what_sglang_resolves",),
          slow=(f"{SCHEDULES}::test_colocated_async_releases_the_broadcast_group_before_the_trainer_lends_its_gpu",)),
    Plant("memory-tag", "rayrl/orchestration/schedules.py",
          'resume_memory_occupation(["kv_cache", "cuda_graph"])',
          'resume_memory_occupation(["kv_cache", "cuda_graphs"])',
          'resume tag "cuda_graphs": a KeyError in SGLang\'s scheduler (offload_tags.remove)',
          fast=(PHASES,), slow=(COLOCATED,)),
    Plant("resume-not-released", "rayrl/orchestration/schedules.py",
          "        parts.engines.wait_idle()  # SGLang asserts no request is running on release\n"
          "        parts.engines.release_memory_occupation()\n",
          "        parts.engines.wait_idle()  # SGLang asserts no request is running on release\n",
          "the engines' weights resumed without a release: a KeyError in SGLang's scheduler",
          fast=(PHASES,), slow=(COLOCATED,)),
    Plant("no-push-at-setup", "rayrl/orchestration/schedules.py",  # issue 41 B
          "        self.devices_with_trainer = True\n        self.engines_take_devices()\n",
          "        self.devices_with_trainer = False\n        parts.weights.release_groups()\n"
          "        parts.trainer.offload()\n        parts.engines.resume_memory_occupation()\n",
          "colocated setup resumes the engines with no push (B): SGLang generates from garbage",
          fast=(PHASES,), slow=(COLOCATED,)),
    Plant("no-push-after-resume", "rayrl/orchestration/schedules.py",
          '        parts.engines.resume_memory_occupation(["weights"])\n'
          "        self.membership.push_weights(self.state.version)",
          '        parts.engines.resume_memory_occupation(["weights"])\n        pass',
          "weights resumed without a push: SGLang (no CPU backup) generates from garbage",
          fast=(PHASES,), slow=(COLOCATED,)),
    Plant("save-while-offloaded", "rayrl/orchestration/schedules.py",  # issue 41 C, D
          "        if self.devices_with_trainer:\n            return fn()\n        self.give_devices_to_trainer()\n",
          "        if True:\n            return fn()\n        self.give_devices_to_trainer()\n",
          "checkpoint save and resume load run on the offloaded trainer (C, D)",
          fast=(f"{PHASES}::test_colocated_async_saves_and_loads_checkpoints_with_the_trainer_onloaded",),
          slow=(COLOCATED,)),
    Plant("replacement-from-offloaded", "rayrl/orchestration/schedules.py",  # issue 41 E
          "        self.with_trainer_memory(lambda: None)\n",
          "        self.membership.push_weights(self.state.version)\n",
          "a replacement engine's weights read from the offloaded trainer (E)",
          fast=(f"{PHASES}::test_colocated_async_a_replacement_engine_gets_weights_from_the_onloaded_trainer",)),
    Plant("no-idle-wait-before-update", "rayrl/orchestration/schedules.py",  # issue 41 F
          "            parts.engines.wait_idle()  # aborted requests leave the batch at the next scheduler step\n",
          "",
          "an update that flushes right after an abort pause (F): SGLang's idle assertion kills it",
          fast=(PHASES,), slow=(f"{SCHEDULES}::test_async_two_steps_drops_stale_groups",)),
    Plant("no-idle-wait-before-release", "rayrl/orchestration/schedules.py",  # issue 41 F
          "        parts.engines.wait_idle()  # SGLang asserts no request is running on release\n",
          "",
          "a release right after the pause (F): SGLang asserts no request runs, and its scheduler dies",
          fast=(PHASES,), slow=(COLOCATED,)),
    Plant("ld-preload-prepended", "rayrl/trainers/saver_preload.py",  # issue 41 G
          '    return {"LD_PRELOAD": hook}',
          '    return {"LD_PRELOAD": ":".join([hook, *others])}',
          "the saver's hook prepended to an existing LD_PRELOAD (G): torch_memory_saver loads it as one library",
          fast=("tests/trainers/test_memory_saver_cpu.py::test_preload_env_gives_torch_memory_saver_exactly_its_own_library",)),
    Plant("unknown-field", "rayrl/engines/client.py",
          '            "flush_cache": flush_cache,\n            "abort_all_requests": abort_all_requests,\n        }\n'
          "        if weight_version is not None:\n            payload[\"weight_version\"] = str(weight_version)\n"
          '        return await self._request("POST", "/update_weights_from_tensor", payload, timeout_s=timeout_s)',
          '            "flush": flush_cache,\n            "abort_all_requests": abort_all_requests,\n        }\n'
          "        if weight_version is not None:\n            payload[\"weight_version\"] = str(weight_version)\n"
          '        return await self._request("POST", "/update_weights_from_tensor", payload, timeout_s=timeout_s)',
          "a field SGLang's request class lacks (FastAPI drops it: the flag is lost)",
          fast=(f"{CLIENT_CONTRACT}::test_every_route_and_field_we_send_exists_in_the_pinned_source",
                f"{STANDIN}::test_while_paused_an_update_applies_at_once_and_abort_mode_returns_running_generations"),
          slow=(f"{SCHEDULES}::test_sync_two_steps_on_the_strict_stand_in",)),
    Plant("removed-version-route", "rayrl/engines/client.py",
          'return await self._request("GET", "/model_info", timeout_s=30.0)',
          'return await self._request("GET", "/get_weight_version", timeout_s=30.0)',
          "the version read from /get_weight_version, a 404 on SGLang 0.5.9",
          fast=(f"{STANDIN}::test_removed_version_route_answers_404_and_every_transport_verifies_through_model_info",)),
    Plant("megatron-load-not-loading", "rayrl/trainers/megatron_checkpoint.py",
          "dist_checkpointing.load(sharded_state(model, optimizer, is_loading=True)",
          "dist_checkpointing.load(sharded_state(model, optimizer, is_loading=False)",
          "Megatron's load told is_loading=False: the optimizer's layout is the save's, not the load's",
          fast=("tests/contracts/test_megatron_contract.py::test_the_optimizer_load_is_told_it_is_loading",)),
)
