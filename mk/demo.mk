# make demo-multinode: the multi-node demo (examples/multinode/run-all.sh). Network
# namespaces for a memory node (RM + agent), a metadata node (maru-server) and two
# worker nodes, each on its own address on one bridge; keys made on the memory node and
# copied to the others; engines on the two workers share a prefix over remote_cxl
# (soft transport); prints the table, checks the checksums, then removes the
# namespaces, processes and files, also on failure. Needs root (ip netns).
# DIR=path: use the binaries in DIR instead of building into $(DEBUG_DIR).
# MARU_MN_CHUNKS (default 64): chunks of the shared prefix.
.PHONY: demo-multinode

demo-multinode: $(if $(DIR),,deps)
ifeq ($(DIR),)
	$(CARGO) build --workspace --bins --target-dir $(TARGET_DIR)
endif
	examples/multinode/run-all.sh $(or $(DIR),$(DEBUG_DIR))
