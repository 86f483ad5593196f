"""The transformers side of the rank-engine comparison (``rank_engine.py``): one process with plain transformers that
loads the checkpoint once and runs each job as one left-padded static batch through ``generate``, and the handle the
comparison drives it through. Run alone: ``python -m benchmarks.rank.rank_engine_reference MODEL`` (one job per
stdin line, one JSON line back)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from benchmarks.rank.rank_engine_jobs import Job
from benchmarks.support.paths import ROOT


class Reference:
    """The transformers process (``--reference``): loads the checkpoint once, then runs one job per line of its
    stdin and answers one JSON line. Kept beside the group so the two sides take turns job by job: a machine whose
    load drifts over minutes then weighs on both alike (they never run at the same time)."""

    def __init__(self, model: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.rank.rank_engine_reference", model],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )

    def run(self, job: Job, reqs: list) -> dict:
        self.proc.stdin.write(json.dumps({"new_tokens": job.new_tokens, "ids": [ids for _, ids in reqs]}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the transformers process ended (exit status {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # still loading (the group failed first): it has nothing left to do
            self.proc.kill()
            self.proc.wait()


def reference_main(model_path: str) -> None:
    import torch
    from transformers import AutoModelForImageTextToText, LogitsProcessor, LogitsProcessorList

    model = AutoModelForImageTextToText.from_pretrained(model_path, local_files_only=True).eval()
    pad = model.generation_config.pad_token_id

    class Clock(LogitsProcessor):
        """Called once per generated token, right after the forward that produced its logits."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    for line in sys.stdin:
        job = json.loads(line)
        ids = job["ids"]
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        clock = Clock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=job["new_tokens"],
                min_new_tokens=job["new_tokens"],
                do_sample=False,
                logits_processor=LogitsProcessorList([clock]),
            )
        steps = len(clock.times) - 1
        print(json.dumps({
            "prompt_tokens": sum(len(x) for x in ids),
            "new_tokens": len(clock.times) * len(ids),
            "prefill_seconds": clock.times[0] - t0,
            "decode_tokens": steps * len(ids),
            "decode_seconds": clock.times[-1] - clock.times[0],
            "step_ms": 1e3 * (clock.times[-1] - clock.times[0]) / steps if steps else None,
            "tokens": out[:, width:].tolist(),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    reference_main(sys.argv[1])
