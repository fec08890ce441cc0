"""kvfleet's control plane: typed resources (:mod:`kvfleet.control.api`), their resolution
(:mod:`kvfleet.control.resolve`) and rendering to Kubernetes manifests (:mod:`kvfleet.control.render`)."""
