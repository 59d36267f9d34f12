"""Smoke test of the HTTP counters benchmark (bench/http_counters.py): a few requests per
variant; checks every line is printed with a number. It does not judge the timings."""

from __future__ import annotations

import importlib
import re

import pytest


def test_prints_each_variant_and_the_share(capsys: pytest.CaptureFixture[str]) -> None:
    bench = importlib.import_module("bench.http_counters")
    assert bench.main(["--requests", "200", "--rounds", "1", "--api-cpu-us", "2000"]) == 0
    text = capsys.readouterr().out
    for label in ("bare, start+end", "counted, start+end", "bare, 8 parts", "counted, 8 parts"):
        assert re.search(rf"{re.escape(label)}\s+[\d.]+ us/request", text), label
    assert re.search(r"counters per request\s+-?[\d.]+ us", text)
    assert re.search(r"share of 2000 us API CPU per request: -?[\d.]+%", text)
