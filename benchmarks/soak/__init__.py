"""The soak benchmark: `python -m benchmarks.soak` (see __main__.py). Its parts: clients.py
(the request kinds), monitor.py (the scrapes), checks.py (the end-of-run checks) and
report.py (CSV and Markdown output)."""
