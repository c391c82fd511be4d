"""Build each trainer's own EAGLE-3 draft and loss step, as its training entry point does, for
a verifier checkpoint directory. Used by train_eval.py and by tests/python/test_trainers.py.

- speculators 0.9: ``create_transformer_layer_config`` + ``Eagle3DraftModel.from_training_args``
  (its ``train/cli.py`` path), loss ``kl_div`` (its default), ``fused`` on CUDA and ``eager``
  on CPU (the fused loss is a Triton kernel).
- SpecForge 0.2: the draft config generated from the target as ``_generate_draft_config`` does
  (full vocabulary: ``draft_vocab_size`` = the target's, identity vocab mapping), the draft
  through ``AutoDraftModel``, ``OnlineEagle3Model`` and ``Eagle3TrainStrategy`` with its
  ``TargetHead``. Its KL loss (``core/loss.py::LogSoftmaxLoss``) is a Triton kernel with no CPU
  path: on CPU, ``cpu_specforge_loss()`` puts in a few lines of torch computing the same
  formula (mean over positions of -Σ target · log_softmax(logits), masked). Everything else
  is SpecForge's code.
"""
from __future__ import annotations

import glob
import json
import os
import warnings

import torch


def ensure_index_json(model_dir: str) -> str:
    """SpecForge's ``TargetHead.load_weights`` reads ``*.index.json``: give a single-file
    checkpoint (like SmolLM2) one, mapping every tensor to ``model.safetensors``. Returns the
    key of the LM head (``model.embed_tokens.weight`` when embeddings are tied)."""
    from safetensors import safe_open

    st = os.path.join(model_dir, "model.safetensors")
    with safe_open(st, framework="pt") as f:
        keys = list(f.keys())
    if not glob.glob(os.path.join(model_dir, "*.index.json")):
        index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in keys}}
        tmp = os.path.join(model_dir, "model.safetensors.index.json.tmp")
        with open(tmp, "w") as fh:
            json.dump(index, fh)
        os.replace(tmp, os.path.join(model_dir, "model.safetensors.index.json"))
    return "lm_head.weight" if "lm_head.weight" in keys else "model.embed_tokens.weight"


def speculators_draft(verifier_dir: str, aux_vllm_ids, ttt_steps: int = 3, attn: str = "sdpa"):
    """speculators' Eagle3DraftModel for the verifier, as ``speculators.train`` builds it."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(verifier_dir).vocab_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tl = create_transformer_layer_config(
            verifier_name_or_path=verifier_dir, num_layers=1, draft_arch="llama", hidden_act=None,
            sliding_window=None, full_attention_indices=[0], mrope_full_head_hack=False)
        return Eagle3DraftModel.from_training_args(
            # The CLI's eagle3 defaults: norm_before_residual and norm_before_fc on.
            verifier_config=tl, t2d=None, d2t=None, draft_vocab_size=vocab, norm_before_residual=True,
            norm_before_fc=True,
            ttt_steps=ttt_steps, verifier_name_or_path=verifier_dir, target_layer_ids=list(aux_vllm_ids),
            draft_attn_impl=attn)


def speculators_call_kwargs(device: str, ttt_steps: int = 3) -> dict:
    """The keyword arguments speculators' Trainer passes to the model (``get_trainer_kwargs``)."""
    from speculators.losses import resolve_loss_config

    # speculators' default on CUDA is its fused Triton loss, but with torch 2.11 on the H200
    # torch.compile refuses it ("ListVariable ... already tracked for mutation" on the kernel
    # configs), so the eager loss (the same KL) is the default; SPECULATORS_LOSS=fused tries it.
    impl = os.environ.get("SPECULATORS_LOSS", "eager")
    return {"ttt_steps": ttt_steps, "ttt_step_loss_decay": 1.0,
            "loss_config": resolve_loss_config("kl_div", impl)}


class _TorchKLLoss:
    """SpecForge's LogSoftmaxLoss formula in plain torch (CPU only; see the module doc)."""

    @staticmethod
    def apply(logits, target, position_mask):
        lp = torch.log_softmax(logits.float(), dim=-1)
        per_position = -(target.float() * lp).sum(-1, keepdim=True) * position_mask.bool()
        return per_position.reshape(-1).mean()


def cpu_specforge_loss() -> None:
    """Let SpecForge's EAGLE-3 model run its loss on CPU (its Triton kernel needs CUDA)."""
    import specforge.algorithms.eagle3.model as em

    em.LogSoftmaxLoss = _TorchKLLoss


def specforge_strategy(verifier_dir: str, ttt_length: int = 3, device: str = "cpu",
                       dtype: torch.dtype = torch.bfloat16, attention_backend: str = "sdpa"):
    """SpecForge's Eagle3TrainStrategy (draft + OnlineEagle3Model + TargetHead) for the verifier."""
    from transformers import AutoConfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from specforge.algorithms.eagle3.model import OnlineEagle3Model
        from specforge.modeling.auto import AutoDraftModel
        from specforge.modeling.target.target_head import TargetHead
        from specforge.training.model_loading import _TARGET_ARCHITECTURE_FIELDS, _draft_config_from_dict
        from specforge.training.strategies.base import Eagle3TrainStrategy

    head_key = ensure_index_json(verifier_dir)
    target = AutoConfig.from_pretrained(verifier_dir)
    payload = {f: getattr(target, f) for f in _TARGET_ARCHITECTURE_FIELDS if getattr(target, f, None) is not None}
    payload.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                   tie_word_embeddings=False, use_cache=True, pad_token_id=0, draft_vocab_size=target.vocab_size)
    draft = AutoDraftModel.from_config(_draft_config_from_dict(payload), attention_backend=attention_backend,
                                       torch_dtype=torch.float32)
    draft.load_embedding(verifier_dir, embedding_key="model.embed_tokens.weight")
    draft.freeze_embedding()
    with torch.no_grad():
        # Full vocabulary: every target token is a draft token (SpecForge's identity mapping).
        draft.t2d.fill_(True)
        draft.d2t.zero_()
    model = OnlineEagle3Model(draft_model=draft, length=ttt_length, attention_backend=attention_backend)
    model = model.to(device=device, dtype=dtype)
    head = TargetHead(verifier_dir)
    head.load_weights(verifier_dir, lm_head_key=head_key)
    head.freeze_weights()
    head = head.eval().to(device=device, dtype=torch.bfloat16)
    return Eagle3TrainStrategy(model, target_head=head)


def simulated_acc_len(per_step_acc) -> float:
    """SpecForge's ``eval/simulated_acc_len``: a0 + a0·a1 + a0·a1·a2 + ... (drafted tokens
    accepted per verify step, the target's own next token not counted)."""
    cumulative, total = 1.0, 0.0
    for a in per_step_acc:
        cumulative *= a
        total += cumulative
    return total
