"""Train an EAGLE-3 draft with speculators' own Trainer fed by hslake, then measure it; or
(``--trainer specforge``) train one with SpecForge's EAGLE-3 model and loss fed by hslake.

  python -m hslake_eagle3.train_eval --dataset file:///tmp/ds --model DIR --heldout heldout.jsonl \
      --export-dir /tmp/spec-files --out OUT [--device cuda] [--max-steps 600]
  python -m hslake_eagle3.train_eval --trainer specforge --dataset file:///tmp/ds --model DIR --out OUT

SpecForge (``--trainer specforge``): its ``Eagle3TrainStrategy`` (draft, ``OnlineEagle3Model``,
``TargetHead``; see drafts.py) fed by ``SpecForgeLoader`` batches, stepped by its own
``BF16Optimizer`` with its defaults (f32 master weights, clipping at 0.5, cosine schedule with
1.5 % warm-up); per-step loss, ``acc_k`` and
``acceptance_rate_k`` as its metrics report them, and its simulated acceptance length. Greedy
draft-and-verify decoding is measured for speculators' draft only (specdec.py runs that model).

1. Training: ``speculators.train.trainer.Trainer`` (unchanged) with
   ``DataLoader(SpeculatorsLoader(dataset), batch_size=None)``; per-step metrics (loss_k,
   full_acc_k, cond_acc_k, tokens/s) are taken from its metric logger.
2. Evaluation on held-out prompts: plain greedy decoding of the target vs greedy draft-and-verify
   with the trained draft (specdec.py): outputs compared token for token, mean
   acceptance length (tokens per target forward) and wall-clock speed-up.
3. Throughput: the same Trainer step fed by the hslake adapter and by speculators' own reader
   (ArrowDataset over ``hslake export --format speculators`` files, its multipack sampler and
   DataLoader), the same number of steps each, continuing on the trained draft.
Writes ``report.json`` and ``report.md`` into --out.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
import tempfile
import time
import warnings

import torch

from hslake_eagle3 import drafts, specdec

warnings.filterwarnings("ignore")


class MetricTap(logging.Handler):
    """Collects the dicts speculators' Trainer logs to ``speculators.metrics``."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records = []

    def emit(self, record):
        if isinstance(record.msg, dict) and "train" in record.msg:
            self.records.append(record.msg)


def tap_metrics() -> MetricTap:
    tap = MetricTap()
    lg = logging.getLogger("speculators.metrics")
    lg.setLevel(logging.INFO)
    lg.addHandler(tap)
    lg.propagate = False
    return tap


def allow_cpu_trainer():
    """speculators' Trainer assumes a GPU (model.to(local_rank), accelerator syncs); for checking
    this script on CPU with tiny sizes (--device cpu), point both at the CPU."""
    import speculators.train.trainer as trainer_module

    trainer_module.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *a, **k: None


def run_trainer(model, loader, steps, lr, save_path, call_kwargs, tap):
    """speculators' Trainer for `steps` steps; returns the metric records of this run."""
    from speculators.train.trainer import Trainer, TrainerConfig

    start = len(tap.records)
    config = TrainerConfig(lr=lr, num_epochs=10_000, save_path=save_path, train_call_kwargs=call_kwargs,
                           val_call_kwargs=call_kwargs, scheduler_type="cosine", scheduler_warmup_steps=steps // 20,
                           scheduler_total_steps=steps, checkpoint_freq=10_000, log_freq=1, max_steps=steps)
    trainer = Trainer(model, config, loader, None)
    # run_training's epoch loop stops at max_steps inside train_epoch; loop epochs ourselves so
    # that no per-epoch checkpoint or validation runs between them.
    epoch = 0
    while trainer.global_step < steps:
        trainer.train_epoch(epoch)
        epoch += 1
    return tap.records[start:]


def step_table(records, ttt):
    rows = []
    for r in records:
        m = r["train"]
        row = {"step": r["global_step"], "loss": m.get("loss"),
               "tokens_per_s": (r.get("profile") or {}).get("tokens_per_s"),
               "fetch_ms": (r.get("profile") or {}).get("fetch_ms")}
        for k in range(ttt):
            for name in ("loss", "full_acc", "cond_acc"):
                row[f"{name}_{k}"] = m.get(f"{name}_{k}")
        rows.append(row)
    return rows


def window_mean(rows, key, last):
    vals = [r[key] for r in rows[-last:] if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def evaluate(model_dir, draft, heldout, device, max_new, k, aux_hf):
    from transformers import AutoModelForCausalLM

    # float32 target: the draft-and-verify block forward and the one-token forward then agree
    # to the last bit far more often than in bf16, so equal outputs test the loop, not rounding.
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    draft = draft.to(device=device, dtype=torch.float32)
    runner = specdec.DraftRunner(draft, aux_hf)
    # The end-of-turn token the answers were generated up to (generate.py stops at it too).
    eos = target.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    prompts = [json.loads(l)["input_ids"] for l in open(heldout) if l.strip()]
    # Warm-up (kernels, allocator) outside the timed runs.
    specdec.greedy(target, prompts[0], 8, eos)
    specdec.speculative(target, runner, prompts[0], 8, eos, k)
    results = []
    for p in prompts:
        plain = specdec.greedy(target, p, max_new, eos)
        spec = specdec.speculative(target, runner, p, max_new, eos, k)
        results.append({"prompt_tokens": len(p), "new_tokens": len(plain.tokens), "equal": plain.tokens == spec.tokens,
                        "plain_s": plain.seconds, "spec_s": spec.seconds, "plain_forwards": plain.target_forwards,
                        "spec_forwards": spec.target_forwards, "accepted": spec.accepted})
    rounds = [a for r in results for a in r["accepted"]]
    plain_s = sum(r["plain_s"] for r in results)
    spec_s = sum(r["spec_s"] for r in results)
    return {
        "prompts": len(results),
        "equal_outputs": sum(r["equal"] for r in results),
        "draft_tokens_per_round": k,
        "mean_acceptance_length": sum(rounds) / max(1, len(rounds)),
        "tokens": sum(r["new_tokens"] for r in results),
        "plain_seconds": plain_s,
        "speculative_seconds": spec_s,
        "speedup": plain_s / spec_s if spec_s else None,
        "plain_target_forwards": sum(r["plain_forwards"] for r in results),
        "speculative_target_forwards": sum(r["spec_forwards"] for r in results),
        "per_prompt": results,
    }


def run_specforge(a):
    """SpecForge's EAGLE-3 training step fed by hslake (see the module doc): report.json/.md."""
    from hslake.integrations.specforge import SpecForgeLoader, train_batch

    cuda = a.device.startswith("cuda")
    if not cuda:
        drafts.cpu_specforge_loss()
    # bf16 as SpecForge trains (its optimizer keeps the f32 master weights), on CPU too.
    strategy = drafts.specforge_strategy(a.model, ttt_length=a.ttt, device=a.device)
    model = strategy.trainable_module()
    from specforge.optimizer import BF16Optimizer

    # SpecForge's own optimizer and defaults: AdamW over f32 master copies, clipping at 0.5,
    # cosine schedule with 1.5 % warm-up.
    opt = BF16Optimizer(model, lr=a.lr, max_grad_norm=0.5, total_steps=a.max_steps, warmup_ratio=0.015)
    model.train()
    loader = SpecForgeLoader(a.dataset, batch_size=a.batch_size, max_len=a.max_len, seed=0,
                             decode_threads=a.decode_threads)
    rows, step, epoch, t0 = [], 0, 0, time.time()
    while step < a.max_steps:
        loader.set_epoch(epoch)
        for batch in loader:
            if step >= a.max_steps:
                break
            t = time.perf_counter()
            out = strategy.forward_loss(train_batch(batch))
            out.loss.backward()
            opt.step()
            if cuda:
                torch.cuda.synchronize()
            tokens = int(batch["attention_mask"].sum())
            row = {"step": step, "loss": out.loss.item(), "tokens_per_s": tokens / (time.perf_counter() - t)}
            for k, (acc, rate) in enumerate(zip(out.metrics["acces"], out.metrics["acceptance_rates"])):
                row[f"acc_{k}"] = float(acc)
                row[f"acceptance_rate_{k}"] = float(rate)
            rows.append(row)
            if step % max(1, a.max_steps // 10) == 0:
                print(f"step {step}: {row}", flush=True)
            step += 1
        epoch += 1
    last = max(1, len(rows) // 10)
    final = {key: window_mean(rows, key, last) for key in rows[0] if key != "step"}
    sim = drafts.simulated_acc_len([final[f"acceptance_rate_{k}"] for k in range(a.ttt)])
    report = {"trainer": "SpecForge 0.2.0 (Eagle3TrainStrategy) fed by hslake.integrations.specforge",
              "device": torch.cuda.get_device_name(0) if cuda else "cpu", "steps": len(rows), "epochs": epoch,
              "train_seconds": time.time() - t0, "batch_size": a.batch_size, "max_len": a.max_len,
              "final_window": final, "simulated_acc_len": sim, "train_steps": rows}
    save_json(report, a.out)
    picks = sorted(set([0] + [int(len(rows) * f) for f in (0.1, 0.25, 0.5, 0.75)] + [len(rows) - 1]))
    lines = [f"Trainer: {report['trainer']}; {report['device']}; {len(rows)} steps of {a.batch_size} x {a.max_len} "
             f"in {report['train_seconds']:.0f} s.", "",
             "| step | loss | " + " | ".join(f"acc_{k} | acceptance_rate_{k}" for k in range(a.ttt)) + " | tokens/s |",
             "|" + " --- |" * (3 + 2 * a.ttt)]
    for i in picks:
        r = rows[i]
        accs = " | ".join(f"{r[f'acc_{k}']:.3f} | {r[f'acceptance_rate_{k}']:.3f}" for k in range(a.ttt))
        lines.append(f"| {r['step']} | {r['loss']:.3f} | {accs} | {r['tokens_per_s']:.0f} |")
    lines += ["", f"Simulated acceptance length (SpecForge's formula on the last 10 % of steps' acceptance rates): "
                  f"{sim:.3f}"]
    with open(os.path.join(a.out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def save_json(report, out):
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True, help="hslake dataset URL (captured with the speculators layers)")
    ap.add_argument("--model", required=True, help="the verifier's HF directory")
    ap.add_argument("--trainer", choices=["speculators", "specforge"], default="speculators")
    ap.add_argument("--heldout", help="JSONL of held-out prompts ({input_ids}; speculators)")
    ap.add_argument("--export-dir", help="`hslake export --format speculators` of the dataset (speculators)")
    ap.add_argument("--batch-size", type=int, default=8, help="SpecForge: samples per batch")
    ap.add_argument("--max-len", type=int, default=2048, help="SpecForge: tokens per sample (its --max-length)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--total-seq-len", type=int, default=8192)
    ap.add_argument("--max-steps", type=int, default=600)
    ap.add_argument("--throughput-steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--num-workers", type=int, default=4, help="DataLoader workers of speculators' own reader")
    ap.add_argument("--decode-threads", type=int, default=4, help="the adapter's hslake decode threads")
    ap.add_argument("--throughput-only", action="store_true",
                    help="skip training and evaluation: only the reader comparison (on an untrained draft)")
    ap.add_argument("--throughput-rounds", type=int, default=2,
                    help="alternate files/adapter runs this many times each (order effects cancel)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    if a.trainer == "specforge":
        return run_specforge(a)
    if not (a.heldout and a.export_dir):
        ap.error("--trainer speculators needs --heldout and --export-dir")
    from transformers import AutoConfig

    from hslake.integrations.speculators import SpeculatorsLoader
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.data import ArrowDataset
    from speculators.models.eagle3.data import shift_batch

    n = AutoConfig.from_pretrained(a.model).num_hidden_layers
    vllm_ids = [2, n // 2, n - 3]
    cuda = a.device.startswith("cuda")
    if not cuda:
        allow_cpu_trainer()
    attn = "simple_flex_attention" if cuda else "sdpa"
    draft = drafts.speculators_draft(a.model, vllm_ids, ttt_steps=a.ttt, attn=attn)
    call_kwargs = drafts.speculators_call_kwargs(a.device, a.ttt)
    tap = tap_metrics()
    work = tempfile.mkdtemp(prefix="eagle3-")
    hidden = draft.config.transformer_layer_config.hidden_size

    def adapter_loader(seed):
        return torch.utils.data.DataLoader(
            SpeculatorsLoader(a.dataset, total_seq_len=a.total_seq_len, seed=seed, decode_threads=a.decode_threads,
                              pin_memory=cuda),
            batch_size=None)

    report = {"trainer": "speculators 0.9.0 (Trainer, unchanged) fed by hslake.integrations.speculators",
              "device": torch.cuda.get_device_name(0) if cuda else "cpu", "verifier_layers": n,
              "aux_vllm_ids": vllm_ids, "total_seq_len": a.total_seq_len}
    if not a.throughput_only:
        t0 = time.time()
        train = step_table(run_trainer(draft, adapter_loader(0), a.max_steps, a.lr, f"{work}/train", call_kwargs, tap),
                           a.ttt)
        train_s = time.time() - t0
        last = max(1, len(train) // 10)
        final = {f"{m}_{k}": window_mean(train, f"{m}_{k}", last) for k in range(a.ttt) for m in ("full_acc", "cond_acc")}
        final["loss"] = window_mean(train, "loss", last)
        sim = drafts.simulated_acc_len([final[f"cond_acc_{k}"] for k in range(a.ttt)])
        print(f"trained {len(train)} steps in {train_s:.0f} s; last 10%: {final}; simulated_acc_len {sim:.3f}", flush=True)
        report.update({"steps": len(train), "train_seconds": train_s, "final_window": final,
                       "simulated_acc_len_specforge_formula": sim, "train_steps": train})
        # Written after each phase: a device call that runs out of time still returns what it measured.
        save_json(report, a.out)

        device = torch.device(a.device)
        model_eval = copy.deepcopy(draft)
        heldout_rows = [l for l in open(a.heldout) if l.strip()][: a.eval_prompts]
        heldout_file = os.path.join(work, "heldout.jsonl")
        with open(heldout_file, "w") as f:
            f.writelines(heldout_rows)
        ev = evaluate(a.model, model_eval, heldout_file, device, a.max_new, a.draft_tokens, vllm_ids)
        del model_eval
        print(f"eval: {ev['equal_outputs']}/{ev['prompts']} equal outputs, acceptance length "
              f"{ev['mean_acceptance_length']:.3f}, speed-up {ev['speedup']:.3f}", flush=True)
        report["eval"] = ev
        save_json(report, a.out)

    # Throughput: the same Trainer step on the same (trained, already compiled) draft, fed by
    # speculators' own file reader, then by the adapter; a copy would make torch.compile
    # recompile the draft's forward.
    warm = min(10, a.throughput_steps // 3)
    ds = ArrowDataset(max_len=a.total_seq_len, datapath=a.export_dir, on_missing="raise")
    files = _setup_dataloader(ds, a.total_seq_len, hidden, num_workers=a.num_workers, preprocess=shift_batch,
                              prefetch_factor=4 if a.num_workers else None)
    rec_files, rec_adapter = [], []
    for rnd in range(a.throughput_rounds):
        rec_files += step_table(run_trainer(draft, files, a.throughput_steps, a.lr, f"{work}/files{rnd}", call_kwargs,
                                            tap), a.ttt)[warm:]
        rec_adapter += step_table(run_trainer(draft, adapter_loader(1 + rnd), a.throughput_steps, a.lr,
                                              f"{work}/adapter{rnd}", call_kwargs, tap), a.ttt)[warm:]

    def tps(rows):
        v = [r["tokens_per_s"] for r in rows if r["tokens_per_s"]]
        return statistics.median(v) if v else None

    def fetch(rows):
        v = [r["fetch_ms"] for r in rows if r["fetch_ms"] is not None]
        return statistics.median(v) if v else None

    throughput = {"steps": a.throughput_steps, "rounds": a.throughput_rounds, "warmup_steps_left_out": warm,
                  "files_tokens_per_s": tps(rec_files), "adapter_tokens_per_s": tps(rec_adapter),
                  "files_fetch_ms": fetch(rec_files), "adapter_fetch_ms": fetch(rec_adapter),
                  "files_reader_workers": a.num_workers}
    if throughput["files_tokens_per_s"] and throughput["adapter_tokens_per_s"]:
        throughput["adapter_over_files"] = throughput["adapter_tokens_per_s"] / throughput["files_tokens_per_s"]
    print(f"throughput: {throughput}", flush=True)

    report["throughput"] = throughput
    save_json(report, a.out)
    with open(os.path.join(a.out, "report.md"), "w") as f:
        f.write(markdown(report, a.ttt))
    print(markdown(report, a.ttt))


def markdown(r, ttt):
    lines = []
    if "train_steps" in r:
        lines += [f"Trainer: {r['trainer']}; {r['device']}; {r['steps']} steps of {r['total_seq_len']} packed "
                  f"tokens in {r['train_seconds']:.0f} s.", "", "| step | loss | " + " | ".join(
                      f"full_acc_{k} | cond_acc_{k}" for k in range(ttt)) + " | tokens/s |",
                  "|" + " --- |" * (3 + 2 * ttt)]
        rows = r["train_steps"]
        picks = sorted(set([0] + [int(len(rows) * f) for f in (0.1, 0.25, 0.5, 0.75)] + [len(rows) - 1]))
        for i in picks:
            s = rows[i]
            accs = " | ".join(f"{s[f'full_acc_{k}']:.3f} | {s[f'cond_acc_{k}']:.3f}" for k in range(ttt))
            lines.append(f"| {s['step']} | {s['loss']:.3f} | {accs} | {s['tokens_per_s'] or 0:.0f} |")
        lines += ["", f"Simulated acceptance length (SpecForge's formula on the last 10 % of steps' cond_acc): "
                      f"{r['simulated_acc_len_specforge_formula']:.3f}"]
    if "eval" in r:
        e = r["eval"]
        lines.append(
            f"Held-out prompts: {e['prompts']}, outputs equal to plain greedy: {e['equal_outputs']}/{e['prompts']}; "
            f"mean acceptance length {e['mean_acceptance_length']:.3f} tokens per target forward "
            f"({e['draft_tokens_per_round']} drafted per round); speed-up {e['speedup']:.3f}x "
            f"({e['plain_seconds']:.2f} s plain, {e['speculative_seconds']:.2f} s speculative, {e['tokens']} tokens).")
    t = r["throughput"]
    lines.append(
        f"Throughput (median tokens/s over {t['rounds']} x {t['steps'] - t['warmup_steps_left_out']} steps each, "
        f"alternating): adapter {t['adapter_tokens_per_s'] or 0:.0f}, speculators' own reader "
        f"{t['files_tokens_per_s'] or 0:.0f} ({t['files_reader_workers']} DataLoader workers), ratio "
        f"{t.get('adapter_over_files', float('nan')):.3f}; median fetch ms adapter {t['adapter_fetch_ms']}, "
        f"files {t['files_fetch_ms']}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
