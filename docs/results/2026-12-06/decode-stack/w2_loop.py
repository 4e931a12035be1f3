import time, sys, os
from quire import LLM, SamplingParams
llm = LLM(model=os.path.expanduser("~/.cache/quire/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
sp = SamplingParams(max_tokens=int(sys.argv[1]) if len(sys.argv)>1 else 512, temperature=0, ignore_eos=True)
llm.generate(["Hello there, tell me a story"], sp)
print("ready", os.getpid(), flush=True)
t=time.perf_counter()
for _ in range(int(sys.argv[2]) if len(sys.argv)>2 else 3):
    out = llm.generate(["Hello there, tell me a story about a dragon and a knight"], sp)
dt=time.perf_counter()-t
print("per token ms", dt*1000/(3*sp.max_tokens))
