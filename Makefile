# The README's two commands (each installs what it needs first).
.PHONY: demo test

demo:
	./deploy/quickstart.sh

test:
	./deploy/test.sh -q
