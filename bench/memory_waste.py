"""KV-cache memory reserved by the paged engine vs a contiguous max-length allocation, on a mixed workload.

`python -m bench.memory_waste [--requests 64] [--block-size 16] [--max-model-len 2048] [--seed 0]`

The workload mixes n = 1 requests, parallel sampling (n = 2..4) and prompts of 16..512 tokens with 16..256
output tokens. It runs through the engine's real Scheduler and BlockManager (with a deterministic stand-in for the
model: memory accounting does not depend on the logits), and at every step it sums over the live requests:
- used: KV slots holding a computed token (a request's prompt counted once, plus each sequence's own tokens),
- paged: slots of the distinct blocks the request holds (shared prompt blocks counted once),
- contiguous: what a max-length allocator reserves: max_model_len slots per sequence (vLLM paper, section 2.3).
It prints peak and time-averaged figures with waste = 1 - used / reserved and the ratio contiguous / paged.
"""
import argparse
import random
from dataclasses import dataclass

from engine.core.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence


@dataclass(slots=True)
class WasteReport:
    peak_used: int
    peak_paged: int
    peak_contiguous: int
    mean_used: float
    mean_paged: float
    mean_contiguous: float
    max_request_excess: int   # largest (paged slots - bound) over requests and steps; <= 0 means the bound held
    num_steps: int

    @property
    def paged_waste(self) -> float:
        return 1.0 - self.mean_used / self.mean_paged

    @property
    def contiguous_waste(self) -> float:
        return 1.0 - self.mean_used / self.mean_contiguous


def make_workload(num_requests: int, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    workload = []
    for _ in range(num_requests):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(16, 512))]
        n = rng.choice([1, 1, 1, 2, 4])
        workload.append((prompt, SamplingParams(n=n, max_tokens=rng.randint(16, 256), ignore_eos=True)))
    return workload


def request_bound(seqs: list[Sequence], block_size: int) -> int:
    """Slots a request may hold: each sequence's tokens rounded up to whole blocks, with the prompt's full blocks
    (shared by all its sequences) counted once."""
    shared = seqs[0].num_prompt_tokens // block_size if len(seqs) > 1 else 0
    return block_size * (shared + sum(-(-s.num_tokens // block_size) - shared for s in seqs))


def measure(workload, *, block_size: int = 16, max_model_len: int = 2048, num_blocks: int = 4096,
            max_num_seqs: int = 64, max_num_batched_tokens: int = 2048) -> WasteReport:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    groups = []
    for i, (prompt, params) in enumerate(workload):
        seq = Sequence(str(i), None, prompt, params, arrival_time=float(i), max_model_len=max_model_len)
        groups.append(seq.group)
        sched.add(seq)
    totals = [0, 0, 0]
    peaks = [0, 0, 0]
    excess = -10**9
    steps = 0
    while sched.has_unfinished():
        output = sched.schedule()   # its block moves matter only to a real cache
        for s in sched.update_from_output(output):
            s.append_token(s.num_tokens % 1000)
            if s.num_output_tokens >= s.max_tokens:
                sched.finish(s)
        used = paged = contiguous = 0
        for group in groups:
            live = [s for s in group.seqs if s.block_table]
            if not live:
                continue
            distinct = len({b for s in live for b in s.block_table})
            prompt_len = live[0].num_prompt_tokens
            used += max(min(s.num_computed_tokens, prompt_len) for s in live) + sum(
                max(s.num_computed_tokens - prompt_len, 0) for s in live)
            paged += distinct * block_size
            contiguous += max_model_len * len(live)
            excess = max(excess, distinct * block_size - request_bound(live, block_size))
        for k, value in enumerate((used, paged, contiguous)):
            totals[k] += value
            peaks[k] = max(peaks[k], value)
        steps += 1
    assert bm.num_free_blocks == bm.num_blocks
    return WasteReport(peaks[0], peaks[1], peaks[2], totals[0] / steps, totals[1] / steps, totals[2] / steps,
                       excess, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    report = measure(make_workload(args.requests, args.seed), block_size=args.block_size,
                     max_model_len=args.max_model_len)
    print(f"workload: {args.requests} requests (n in 1..4, prompts 16-512, outputs 16-256 tokens), "
          f"block_size {args.block_size}, max_model_len {args.max_model_len}, {report.num_steps} steps")
    print(f"{'':<26}{'peak slots':>12}{'mean slots':>12}{'waste (mean)':>14}")
    print(f"{'tokens held (used)':<26}{report.peak_used:>12}{report.mean_used:>12.0f}{'':>14}")
    print(f"{'paged (this engine)':<26}{report.peak_paged:>12}{report.mean_paged:>12.0f}{report.paged_waste:>14.1%}")
    print(f"{'contiguous max-length':<26}{report.peak_contiguous:>12}{report.mean_contiguous:>12.0f}"
          f"{report.contiguous_waste:>14.1%}")
    print(f"contiguous / paged reserved: {report.mean_contiguous / report.mean_paged:.1f}x (mean), "
          f"{report.peak_contiguous / report.peak_paged:.1f}x (peak); "
          f"per-request bound {'held' if report.max_request_excess <= 0 else 'VIOLATED'} "
          f"(max excess {report.max_request_excess} slots)")


if __name__ == "__main__":
    main()
