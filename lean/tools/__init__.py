"""The tools around a run: the certificate (``equivalence``), the benchmarks (``bench/``), the published-size plan
on the meta device (``meta_plan``), ``lean sample`` (``sampling``) and ``lean ui`` (``ui``). They import the run's
modules; nothing in the run imports them."""
