"""Profile the host-only step (cProfile): python prof_host.py N steps [quire bench host flags]; the figures of the second pass (docs/bench.md)"""
import cProfile
import pstats
import sys

from quire.bench.host_overhead import measure
from quire.bench.quire_engine import build_engine
from quire.entrypoints.cli import build_parser, parse_args
from quire.entrypoints.cli.common import open_registry
from quire.entrypoints.cli.engine_options import engine_config_from_args

n = int(sys.argv[1]); steps = int(sys.argv[2])
args = parse_args(build_parser(), ["bench", "host", "--platform-options", "threads=1", *sys.argv[3:]])
engine = build_engine(engine_config_from_args(args), open_registry(args))
prof = cProfile.Profile()
r = measure(engine, n, steps, profile=prof)
print({k: round(v, 3) for k, v in r.figures().items()})
st = pstats.Stats(prof); st.sort_stats("tottime").print_stats(35)
st.sort_stats("cumulative").print_stats(45)
