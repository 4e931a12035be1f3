import os, sys, time, random
def status():
    d={}
    for l in open('/proc/self/status'):
        k=l.split(':')[0]
        if k in ('VmHWM','VmRSS','RssAnon','RssFile'): d[k]=int(l.split()[1])//1024
    return d
from quire import LLM, SamplingParams
llm = LLM(model=os.path.expanduser("~/.cache/quire/models/SmolLM2-135M-Instruct.Q4_1.gguf"), kv_cache_dtype="bfloat16", kv_cache_memory=389<<20)
random.seed(0)
prompts=[{"prompt_token_ids":[random.randrange(100,40000) for _ in range(128)]} for _ in range(64)]
sp=SamplingParams(max_tokens=int(os.environ.get("MT","128")), temperature=0, ignore_eos=True)
print('before', status())
open('/proc/self/clear_refs','w').write('5')
t=time.perf_counter()
llm.generate(prompts, sp)
dt=time.perf_counter()-t
print('after', status(), 'tok/s', 64*256/dt)
