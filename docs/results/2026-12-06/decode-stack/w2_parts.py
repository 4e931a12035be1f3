import time, sys, os, collections
T=collections.defaultdict(float); N=collections.Counter()
def wrap(obj, name, label=None):
    f=getattr(obj,name); label=label or f"{getattr(obj,'__name__',obj)}.{name}"
    def g(*a, **k):
        t=time.perf_counter(); r=f(*a, **k); T[label]+=time.perf_counter()-t; N[label]+=1; return r
    setattr(obj,name,g)
from quire import LLM, SamplingParams
from quire.platforms.cpu.sdpa_attention import CpuSdpaAttentionBackend
from quire.executor.model_runner import ModelRunner
from quire.executor.input_batch import InputBatch
from quire.models.layers.embedding import VocabParallelEmbedding
from quire.models.layers.norm import RMSNorm
from quire.sampler import Sampler
from quire.platforms.cpu.fused_stack import FusedDecodeStack
from quire.engine.core import EngineCore
import quire.executor.model_runner as mr
wrap(CpuSdpaAttentionBackend,'build_metadata'); wrap(InputBatch,'prepare'); wrap(VocabParallelEmbedding,'forward')
wrap(RMSNorm,'forward'); wrap(Sampler,'sample'); wrap(FusedDecodeStack,'__call__'); wrap(ModelRunner,'execute'); wrap(ModelRunner,'_logits'); wrap(EngineCore,'step')
llm = LLM(model=os.path.expanduser("~/.cache/quire/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
sp = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
llm.generate(["Hello there"], sp)
T.clear(); N.clear()
t=time.perf_counter()
llm.generate(["Hello there, tell me a story about a dragon and a knight"], sp)
dt=time.perf_counter()-t
print("per token ms", dt*1000/256)
for k in sorted(T, key=lambda k:-T[k]): print(f"{k:45s} {N[k]:5d} {T[k]/257*1e6:8.1f} us/step")
