"""Adapter-only updates on the generator side: the spec, the tensors' checks, the folder vLLM
loads, the merge, and the slots that give each version a fresh name and retire unused ones."""

from __future__ import annotations

import json

import pytest
import torch
from peft import (  # imported once here: its first import takes seconds
    LoraConfig,
    get_peft_model,
    get_peft_model_state_dict,
)

from asyncrl.generators.engines.lora import (
    AdapterSlots,
    AdapterSpec,
    FolderWeights,
    check_adapter,
    engine_lora_rank,
    merge_adapter,
    merges_adapters,
    read_adapter,
    split_name,
    write_adapter,
)
from asyncrl.weights.update import WeightSyncError
from tests.factories import small_qwen2

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
META = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "base_version": 0}


def peft_model(seed: int = 3):
    """A 2-layer Qwen2 with a rank-4 adapter on every linear layer, lora_B random (peft starts it at 0)."""
    model = get_peft_model(small_qwen2(64), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def adapter_tensors(model) -> list:
    return list(get_peft_model_state_dict(model).items())


def test_spec_from_meta_reads_the_learner_contract_and_names_bad_fields():
    spec = AdapterSpec.from_meta(META)
    assert spec.r == 4 and spec.scaling == 2.0 and spec.target_modules == tuple(TARGETS) and spec.base_version == 0
    assert AdapterSpec.from_meta({**META, "use_rslora": True}).scaling == 4.0  # alpha / sqrt(r)
    for bad, field in [({**META, "r": 0}, "r"), ({**META, "target_modules": "q_proj"}, "target_modules")]:
        with pytest.raises(WeightSyncError, match=field):
            AdapterSpec.from_meta(bad)
    with pytest.raises(WeightSyncError, match="lora_alpha"):
        AdapterSpec.from_meta({"r": 4, "target_modules": TARGETS})


def test_lora_serving_names_merge_or_adapter_and_auto_merges_on_the_cpu_backend():
    from vllm.platforms import current_platform

    assert merges_adapters("merge") and not merges_adapters("adapter")
    assert merges_adapters("auto") == current_platform.is_cpu()


def test_engine_rank_rounds_up_to_what_vllm_accepts():
    assert [engine_lora_rank(r) for r in (1, 2, 8, 9, 16, 64)] == [1, 8, 8, 16, 16, 64]
    with pytest.raises(ValueError, match="model.lora.rank"):
        engine_lora_rank(1024)


def test_peft_names_map_to_the_weights_they_update():
    model = peft_model()
    pairs = check_adapter(adapter_tensors(model), AdapterSpec.from_meta(META))
    hf_names = {name for name, _ in small_qwen2(64).named_parameters()}
    assert set(pairs) <= hf_names and len(pairs) == 2 * len(TARGETS)
    with pytest.raises(WeightSyncError, match="named as peft"):
        split_name("model.layers.0.self_attn.q_proj.weight")


def test_check_refuses_a_half_pair_a_foreign_module_and_a_wrong_rank():
    named = adapter_tensors(peft_model())
    spec = AdapterSpec.from_meta(META)
    with pytest.raises(WeightSyncError, match="both factors"):
        check_adapter([(n, t) for n, t in named if "q_proj.lora_B" not in n], spec)
    with pytest.raises(WeightSyncError, match="target_modules"):
        check_adapter(named, AdapterSpec.from_meta({**META, "target_modules": ["q_proj"]}))
    with pytest.raises(WeightSyncError, match="r = 8"):
        check_adapter(named, AdapterSpec.from_meta({**META, "r": 8}))


def test_written_folder_is_a_peft_adapter_that_reads_back(tmp_path):
    named = adapter_tensors(peft_model())
    folder = write_adapter(named, AdapterSpec.from_meta(META), tmp_path / "v1")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["target_modules"] == TARGETS
    back = dict(read_adapter(folder))
    assert set(back) == {n for n, _ in named} and all(torch.equal(back[n], t) for n, t in named)


def test_merge_gives_the_weights_peft_merges():
    model = peft_model()
    named = adapter_tensors(model)
    base = {n: p.detach().clone() for n, p in model.base_model.model.named_parameters() if "lora" not in n}
    base = {n.replace(".base_layer", ""): t for n, t in base.items()}
    merged = dict(merge_adapter(base, named, AdapterSpec.from_meta(META)))
    want = model.merge_and_unload().state_dict()
    assert len(merged) == 2 * len(TARGETS)
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-5, atol=1e-6)
        assert not torch.equal(tensor, base[name])


def test_the_base_is_read_from_the_model_folder_on_demand(tmp_path):
    from safetensors.torch import save_file

    model = small_qwen2(64)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    save_file(state, str(tmp_path / "model.safetensors"))
    base = FolderWeights(tmp_path)
    name = "model.layers.1.mlp.down_proj.weight"
    assert name in base and "nope.weight" not in base and torch.equal(base[name], state[name])
    with pytest.raises(FileNotFoundError, match="safetensors"):
        FolderWeights(tmp_path / "empty")


def test_slots_never_reuse_a_name_and_retire_only_unused_adapters(tmp_path):
    slots = AdapterSlots(root=tmp_path, make_request=lambda name, lora_id, path: (name, lora_id, path))
    named, spec = adapter_tensors(peft_model()), AdapterSpec.from_meta(META)
    first = slots.add(named, spec, version=1)
    slots.commit(first)
    held = slots.acquire()  # a request running on version 1
    assert held is first and first.request == (first.name, first.lora_id, str(first.folder))
    second = slots.add(named, spec, version=2)
    slots.commit(second)
    assert slots.retire() == [] and first.folder.exists()  # still in use
    assert slots.acquire() is second  # new requests take the newest
    slots.release(held)
    assert slots.retire() == [first] and not first.folder.exists()
    failed = slots.add(named, spec, version=3)  # a load that fails: its id is spent all the same
    slots.discard(failed)
    third = slots.add(named, spec, version=3)
    slots.commit(third)
    slots.release(second)
    assert [a.name for a in slots.retire()] == [second.name] and slots.live == [third]
    ids = [first.lora_id, second.lora_id, failed.lora_id, third.lora_id]
    assert ids == sorted(set(ids)) and len(set(slots.used_names)) == len(slots.used_names) == 3
    with pytest.raises(RuntimeError, match="released more often"):
        slots.release(first)
    slots.close()
    assert not slots.root.exists()
