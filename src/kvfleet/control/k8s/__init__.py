"""Builders of Kubernetes objects (plain dicts) for :mod:`kvfleet.control.render`; one concern per module."""
