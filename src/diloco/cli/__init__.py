"""The `diloco` command (docs/architecture.md): main.py parses (parser.py) and dispatches; the
verbs are train.py, plan.py, serve.py (serve, worker, replay) and use.py (eval, generate, export,
plot);
configure.py turns the flags into a run's config, the one merge of flags every verb uses."""
