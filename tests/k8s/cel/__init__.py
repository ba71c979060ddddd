"""CEL for custom resources: a CRD's ``x-kubernetes-validations`` rules compiled and
costed when the CRD is created (as cel-go and the server do it), and evaluated on each
custom resource written (with cel-python)."""
