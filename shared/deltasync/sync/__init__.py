"""The sync root: storage backends, its manifests (run, head), anchors, the publisher and the subscriber."""
