"""What ``/metrics`` shows: the families of some registries, each sample labelled with the
served model's name as vLLM labels its own.

Every sample gets ``model_name``; ``vllm:`` families also get vLLM's ``engine`` label (one
engine: ``"0"``). The ``_created`` samples prometheus_client adds to counters and histograms
are left out: vLLM's dashboards do not use them and they double the page.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

VLLM_PREFIX = "vllm:"
ENGINE_INDEX = "0"
_WITH_CREATED = frozenset({"counter", "histogram", "gaugehistogram", "summary"})


class LabelledExport:
    """A collector re-exporting ``sources`` with the ``model_name`` (and ``engine``) labels."""

    def __init__(self, sources: Sequence[CollectorRegistry], model_name: str) -> None:
        self._sources = tuple(sources)
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for source in self._sources:
            for family in source.collect():
                yield self._labelled(family)

    def _labelled(self, family: Metric) -> Metric:
        extra = {"model_name": self._model_name}
        if family.name.startswith(VLLM_PREFIX):
            extra["engine"] = ENGINE_INDEX
        created = family.name + "_created" if family.type in _WITH_CREATED else None
        out = Metric(family.name, family.documentation, family.type)
        for s in family.samples:
            if s.name != created:
                out.add_sample(
                    s.name, {**extra, **s.labels}, s.value, s.timestamp, s.exemplar,
                    s.native_histogram,
                )
        return out
