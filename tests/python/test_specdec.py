"""The greedy draft-and-verify loop of the EAGLE-3 example (examples/eagle3, hslake_eagle3.specdec): its
output equals plain greedy decoding token for token, whatever the draft proposes, and a draft
that proposes the target's own continuation is accepted whole."""
from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("speculators")
from hslake_eagle3 import drafts, specdec  # noqa: E402

warnings.filterwarnings("ignore")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=256, tie_word_embeddings=True)
    target = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("v") / "llama"
    target.save_pretrained(path)
    draft = drafts.speculators_draft(str(path), [2, 4, 5])
    return target, specdec.DraftRunner(draft, [2, 4, 5])


PROMPTS = [[5, 17, 3, 88, 41], [1, 2, 3], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]


@pytest.mark.parametrize("k", [1, 4])
def test_speculative_output_equals_greedy_with_an_untrained_draft(models, k):
    target, runner = models
    for p in PROMPTS:
        plain = specdec.greedy(target, p, 24, eos=None)
        spec = specdec.speculative(target, runner, p, 24, eos=None, k=k)
        assert spec.tokens == plain.tokens
        assert sum(spec.accepted) == len(spec.tokens) - 1  # the prefill gives the first token
        assert spec.target_forwards == len(spec.accepted) + 1


def test_a_draft_proposing_the_targets_continuation_is_accepted_whole(models, monkeypatch):
    target, runner = models
    p = PROMPTS[0]
    plain = specdec.greedy(target, p, 25, eos=None)
    # An oracle draft: the next k tokens of the target's own greedy output.
    done = {"n": 1}

    def oracle(tokens_next, projected, k):
        start = done["n"]
        done["n"] += k + 1
        return plain.tokens[start:start + k]

    monkeypatch.setattr(runner, "propose", oracle)
    spec = specdec.speculative(target, runner, p, 25, eos=None, k=4)
    assert spec.tokens == plain.tokens
    assert spec.accepted == [5] * 4 + [4]  # 1 + 5·4 = 21, then the last round stops at 25
    assert spec.target_forwards == 1 + 5 < plain.target_forwards == 25


def test_decoding_stops_at_the_end_of_turn_token(models):
    target, runner = models
    plain = specdec.greedy(target, PROMPTS[1], 30, eos=None)
    eos = plain.tokens[6]
    first = plain.tokens.index(eos)
    stopped = specdec.speculative(target, runner, PROMPTS[1], 30, eos=eos, k=3)
    assert stopped.tokens == plain.tokens[:first + 1]
