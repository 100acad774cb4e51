"""The control-plane scale benchmark's parts; bench/control_plane_scale.py runs them (its
docstring says what is measured and how to read it).

    config.py           `Config`, the periods it mirrors from the project, the job, `PhaseFailed`
    simulate.py         a simulated torchrun agent + its worker (threads) and what they count
    hosts.py            the spawned host processes running them, and the benchmark's handle
    etcd_metrics.py     etcd's Prometheus /metrics: scraping, sums, the steady window's figures
    rdzv_watch.py       torch's rendezvous state, read from etcd while a size runs
    controller_loop.py  `Controller.run` in a thread, its ticks and drains timed
    sql_store.py        counting the store's writes; the throwaway PostgreSQL
    measure.py          one size, phase by phase -> its row
    figures.py          samples -> the row's figures
    judge.py            problems, what degraded, what broke first
    plot.py             the PNG

Imported as `control_plane`, with bench/ on sys.path (as bench/_common.py is); the host
processes are spawned with `control_plane.hosts.host_main` as their target, so that module stays
importable on its own."""
