"""The observation side: what reads the event stream and never touches a layer's internals.

* :mod:`.events` — the one event stream every process appends to (JSON lines);
* :mod:`.goodput` — goodput, rollback, freshness and recovery per fault, from the events;
* :mod:`.timeline` — recovery times and step periods of the demo workers' and benchmarks' runs;
* :mod:`.advisor` — the Young/Daly checkpoint interval, with local checkpoints too;
* :mod:`.table`, :mod:`.report`, :mod:`.diagram` — how the results are shown (``python -m nvrx_lab.observe.report``).
"""
