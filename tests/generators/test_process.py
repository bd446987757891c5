"""The generator loop's guard against prompts the engine would refuse (the vLLM side of the rule
is checked against a real engine in test_engine.py)."""

from asyncrl.generators.groups import refuse_too_long
from asyncrl.models.char_tokenizer import build_char_tokenizer


def test_prompts_of_max_model_len_tokens_or_more_are_refused(tmp_path):
    tokenizer = build_char_tokenizer(tmp_path)  # one token per character
    rows = [{"group_id": f"g{i}", "text": "x" * k} for i, k in enumerate((63, 64, 3, 200))]
    taken, refused = refuse_too_long(tokenizer, rows, max_model_len=64)
    assert [r["group_id"] for r in taken] == ["g0", "g2"]
    assert [r["group_id"] for r in refused] == ["g1", "g3"]
    assert refuse_too_long(None, rows, 64) == (rows, [])  # an engine without a tokenizer takes all
