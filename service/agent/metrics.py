"""The agent's Prometheus metrics, read from its parts when Prometheus scrapes."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from service.agent.agent import Agent


class AgentCollector:
    def __init__(self, agent: Agent):
        self.agent = agent

    def collect(self):
        a = self.agent
        group = [str(a.settings.group)]
        for family, value in (
            (GaugeMetricFamily("ftctl_agent_group_running", "1 while the group's torchrun runs", labels=["group"]),
             float(a.supervisor.running)),
            (GaugeMetricFamily("ftctl_agent_spare_ready", "1 while a warm spare is ready to be promoted",
                               labels=["group"]), float(bool(a.spare) and a.spare.state() == "ready")),
            (GaugeMetricFamily("ftctl_agent_events_buffered", "events waiting for the control plane",
                               labels=["group"]), float(len(a.forwarder.buffer))),
            (CounterMetricFamily("ftctl_agent_events_dropped", "events dropped because the buffer was full",
                                 labels=["group"]), float(a.forwarder.dropped)),
            (CounterMetricFamily("ftctl_agent_events_refused", "events the control plane refused (a 4xx), dropped",
                                 labels=["group"]), float(a.forwarder.refused)),
            (CounterMetricFamily("ftctl_agent_events_invalid", "lines of the event files that are no event",
                                 labels=["group"]), float(a.forwarder.invalid)),
            (CounterMetricFamily("ftctl_agent_events_forwarded", "events delivered to the control plane",
                                 labels=["group"]), float(a.forwarder.forwarded)),
            (CounterMetricFamily("ftctl_agent_group_starts", "times the agent started the group", labels=["group"]),
             float(a.supervisor.starts)),
        ):
            family.add_metric(group, value)
            yield family
