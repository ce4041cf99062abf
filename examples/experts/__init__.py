"""Experts that show: two expert teachers, a generalist and a smaller student on two checkable tasks.

Run ``python -m examples.experts``; see ``docs/guides/teachers.md``.
"""
