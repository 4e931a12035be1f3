"""A reader of the Prometheus text format (0.0.4) for tests: written from the format's
description, separately from ``prometheus_client``, so that each checks the other."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)")
_META = re.compile(r"# (HELP|TYPE) ([a-zA-Z_:][a-zA-Z0-9_:]*) (.*)")


def parse_labels(text: str) -> dict[str, str]:
    """``{a="x",b="y\\"z"}`` -> ``{"a": "x", "b": 'y"z'}``, undoing the format's escapes."""
    labels, i = {}, 1
    unescape = {"\\": "\\", '"': '"', "n": "\n"}
    while text[i] != "}":
        eq = text.index("=", i)
        name = text[i:eq]
        assert text[eq + 1] == '"', text
        i, value = eq + 2, []
        while text[i] != '"':
            if text[i] == "\\":
                value.append(unescape[text[i + 1]])
                i += 2
            else:
                value.append(text[i])
                i += 1
        labels[name] = "".join(value)
        i += 1
        if text[i] == ",":
            i += 1
    assert i == len(text) - 1, text
    return labels


def parse(text: str) -> tuple[dict, dict, dict]:
    """Exposition text -> (samples keyed by (name, sorted labels), types, helps)."""
    assert text.endswith("\n")
    samples, types, helps = {}, {}, {}
    for line in text.splitlines():
        meta = _META.fullmatch(line)
        if meta:
            kind, name, rest = meta.groups()
            (helps if kind == "HELP" else types)[name] = rest
            continue
        m = _SAMPLE.fullmatch(line)
        assert m, f"not a sample line: {line!r}"
        name, labels, value = m.groups()
        key = (name, tuple(sorted(parse_labels(labels).items())) if labels else ())
        assert key not in samples, f"repeated sample {key}"
        samples[key] = float(value)
    return samples, types, helps


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def buckets(samples: dict, name: str) -> dict[float, float]:
    return {float(dict(lbl)["le"]): v for (n, lbl), v in samples.items()
            if n == f"{name}_bucket"}
