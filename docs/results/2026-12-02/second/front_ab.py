"""Time the engine's front alone (LLMEngine._apply + _outputs) on made-up core outputs:
python front_ab.py [batch ...]; run it with PYTHONPATH set to each side's core/ (docs/bench.md)."""
import cProfile
import pstats
import random
import statistics
import sys
import time

from quire.config import EngineConfig
from quire.engine.llm_engine import LLMEngine
from quire.engine.messages import CoreOutputs, SeqUpdate
from quire.engine.output_processor import OutputProcessor, RequestState
from quire.model_store import model_path_of
from quire.outputs import RequestOutputKind
from quire.sampling_params import SamplingParams
from quire.tokenizer import load_tokenizer

STEPS, ROUNDS = 40, 5
tokenizer = load_tokenizer(model_path_of(EngineConfig(model="SmolLM2-135M-Instruct")))
text = tokenizer("The quick brown fox jumps over the lazy dog, and then it runs away into "
                 "the forest where nobody can find it again. " * 40)["input_ids"]


class _Client:
    def stop_sequence(self, request_id, index):
        pass


def front(batch, kind, profile=None):
    engine = LLMEngine.__new__(LLMEngine)
    engine.processor, engine.client = OutputProcessor(tokenizer), _Client()
    engine._requests, engine._embeddings = {}, {}
    params = SamplingParams(max_tokens=10_000, ignore_eos=True, output_kind=kind)
    rng = random.Random(batch)
    starts = []
    for i in range(batch):
        req = RequestState(str(i), None, text[:16], params, arrival_time=time.monotonic())
        engine.processor.track(req, 0)
        engine._requests[req.request_id] = req
        starts.append(rng.randrange(16, len(text) - STEPS))
    times = []
    for step in range(STEPS):
        outs = CoreOutputs(time=time.monotonic(), updates=[
            SeqUpdate(str(i), 0, text[starts[i] + step], first_scheduled_time=1.0)
            for i in range(batch)])
        if profile is not None:
            profile.enable()
        started = time.perf_counter()
        changed, embedded = {}, []
        engine._apply(outs, changed, embedded)
        got = engine._outputs(changed, False)
        times.append(time.perf_counter() - started)
        if profile is not None:
            profile.disable()
        assert len(got) == batch
    return statistics.median(times)


for batch in [int(b) for b in sys.argv[1:]] or [64, 256]:
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        runs = [front(batch, kind) for _ in range(ROUNDS)]
        profile = cProfile.Profile()
        front(batch, kind, profile)
        calls = pstats.Stats(profile).total_calls / STEPS
        print(f"batch {batch} {kind.name.lower()}: front ms median {statistics.median(runs)*1e3:.3f}"
              f" best {min(runs)*1e3:.3f} ({ROUNDS} rounds x {STEPS} steps);"
              f" {calls:.0f} Python calls a step")
