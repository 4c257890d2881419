"""The fleet's /metrics: the front's own series (refusals, gate overrides, weight
updates: serving.metrics over the Fleet) and every replica's, read from the replica
on each scrape, with a `replica` label added. One family per name, so sums over the
replicas are plain PromQL (`sum without (replica) (...)`). A replica that does not
answer within SCRAPE_TIMEOUT_S is left out of that scrape; its counters resume from
where they were when it answers again, and restart from zero when Ray restarts it
(Prometheus' rate() reads that as a counter reset).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

SCRAPE_TIMEOUT_S = 5.0


class FleetRegistry(CollectorRegistry):
    """A registry whose collect() adds the replicas' families to its own."""

    def __init__(self):
        super().__init__()
        self.fleet = None   # set once the fleet is up

    def collect(self):
        families: dict = {}
        for family in super().collect():
            families[family.name] = family
        for replica, text in self._replica_texts():
            for family in text_string_to_metric_families(text):
                into = families.get(family.name)
                if into is None:
                    into = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                          family.unit)
                into.samples.extend(Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp,
                                           s.exemplar) for s in family.samples)
        yield from families.values()

    def _replica_texts(self) -> list:
        import ray
        fleet = self.fleet
        if fleet is None:
            return []
        names = sorted(fleet.actors)
        refs = [fleet.actors[n].metrics_text.remote() for n in names]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=SCRAPE_TIMEOUT_S)
        out = []
        for name, ref in zip(names, refs):
            if ref in ready:
                try:
                    out.append((name, ray.get(ref).decode()))
                except ray.exceptions.RayError:
                    pass
        return out
