"""One sequence's step of R tokens after a 200-token context, on SmolLM2-135M Q4_1 at the
defaults: what a speculative decoding verification step costs against a decode step
(R = 1). Prints the mean of 20 runner steps per R. Run from the repository root, with
this file's path and an optional dtype."""

import sys
import time

from quire import LLM
from quire.executor.messages import StepItem

llm = LLM(model="SmolLM2-135M-Instruct", device="cpu",
          dtype=sys.argv[1] if len(sys.argv) > 1 else "auto")
runner = llm.engine.core.executor.worker.runner
ctx, pages = 200, list(range(16))
runner.execute([StepItem(0, list(range(5, 5 + ctx)), 0, pages, True)])  # the context
for rows in (1, 2, 3, 4, 5, 6, 8):
    items = [StepItem(0, [100 + i for i in range(rows)], ctx, [], True, first_page=16)]
    for _ in range(3):
        runner.execute(items)
    start = time.perf_counter()
    for _ in range(20):
        runner.execute(items)
    print(f"{rows} rows: {(time.perf_counter() - start) / 20 * 1000:.2f} ms")
