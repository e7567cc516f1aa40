# comet - build libcomet (static and shared), the `comet` tool and the tests.
#   make            build everything into build/: the libraries, the tool, the tests and
#                   build/handle_memory
#   make test       build the tool and the tests, run the C and Python tests (GPU and torch
#                   tests skip visibly)
#   make bench      build and run `comet bench` on every visible GPU
#   make PTXAS_V=1  print the kernels' register, shared memory and spill report
# NCCL >= 2.28 is found by scripts/find-nccl.sh, in this order: $NCCL_HOME when set (that
# one, or an error naming it); else, where PyTorch is installed, the NCCL release PyTorch
# loads (its nvidia-nccl package first), so the Python package runs beside it; else the
# CUDA toolkit, the system paths, an installed nvidia-nccl-cu13 / -cu12 package.
#
# libcomet.so exports the comet_* names of include/comet.h alone (hidden visibility, the
# COMET_API macro). The harness (harness/: launcher, float64 reference, synthetic data,
# timelines) is a static library that the tool and the tests link beside libcomet.a.

CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(shell command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc))
NVCC      := $(CUDA_HOME)/bin/nvcc
CC        ?= gcc
BUILD     := build
.DEFAULT_GOAL := all

# Where NCCL lives, found once per build directory (make clean to look again; another
# NCCL_HOME than the one it was found with looks again by itself). make clean needs none.
ifneq ($(MAKECMDGOALS),clean)
include $(BUILD)/nccl.mk
endif
ifneq ($(NCCL_FOUND_WITH),$(NCCL_HOME))
NCCL_LOOK_AGAIN := FORCE
endif
$(BUILD)/nccl.mk: scripts/find-nccl.sh $(NCCL_LOOK_AGAIN)
	@mkdir -p $(BUILD)
	@scripts/find-nccl.sh > $@.tmp && mv $@.tmp $@ || { rm -f $@.tmp; exit 1; }

ARCH      := -gencode=arch=compute_90a,code=sm_90a
INCLUDES  := -Iinclude -Isrc -I$(NCCL_INC) -I$(CUDA_HOME)/include
CFLAGS    := -std=c11 -O2 -g -Wall -Wextra -Werror=implicit-function-declaration -fPIC -fvisibility=hidden $(INCLUDES)
NVCCFLAGS := -std=c++17 -O3 -g $(ARCH) -Xcompiler -fPIC,-Wall,-fvisibility=hidden $(INCLUDES) $(if $(PTXAS_V),-Xptxas -v)
LDLIBS    := -L$(CUDA_HOME)/lib64 -lcublas -lcublasLt -lcudart -L$(NCCL_LIB) -l:libnccl.so.2 \
             -Wl,-rpath,$(NCCL_LIB) -Wl,-rpath,$(CUDA_HOME)/lib64 -lstdc++ -lm -lpthread -ldl -lrt

LIB_SRC     := $(wildcard src/*/*.c src/*/*.cu)
HARNESS_SRC := $(wildcard harness/*.c harness/*.cu)
LIB_OBJ     := $(patsubst %,$(BUILD)/%.o,$(basename $(LIB_SRC)))
HARNESS_OBJ := $(patsubst %,$(BUILD)/%.o,$(basename $(HARNESS_SRC)))
TOOL_OBJ    := $(patsubst %.c,$(BUILD)/%.o,$(wildcard tools/*.c))
TEST_OBJ    := $(patsubst %.c,$(BUILD)/%.o,$(wildcard tests/*.c))
HEADERS     := $(wildcard include/*.h src/*/*.h src/*/*.cuh harness/*.h tests/*.h tools/*.h)
STATIC      := $(BUILD)/libcomet_harness.a $(BUILD)/libcomet.a

all: $(BUILD)/libcomet.a $(BUILD)/libcomet.so $(BUILD)/comet $(BUILD)/comet_tests $(BUILD)/handle_memory

$(BUILD)/%.o: %.c $(HEADERS) $(BUILD)/nccl.mk
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/%.o: %.cu $(HEADERS) $(BUILD)/nccl.mk
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(BUILD)/libcomet.a: $(LIB_OBJ)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/libcomet_harness.a: $(HARNESS_OBJ)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/libcomet.so: $(LIB_OBJ)
	$(CC) -shared -o $@ $^ $(LDLIBS)

$(BUILD)/comet: $(TOOL_OBJ) $(STATIC)
	$(CC) -o $@ $(TOOL_OBJ) $(STATIC) $(LDLIBS)

$(BUILD)/comet_tests: $(TEST_OBJ) $(STATIC)
	$(CC) -o $@ $(TEST_OBJ) $(STATIC) $(LDLIBS)

# The device memory of a handle per preset (bench/handle_memory.c), on one GPU.
$(BUILD)/handle_memory: $(BUILD)/bench/handle_memory.o $(BUILD)/libcomet.a
	$(CC) -o $@ $^ $(LDLIBS)

# The C tests, then the Python package's CPU tests; one closing line sums both. The tool
# is built too, so every source file compiles in CI.
test: $(BUILD)/comet_tests $(BUILD)/libcomet.so $(BUILD)/comet $(BUILD)/handle_memory
	scripts/run-tests.sh

bench: $(BUILD)/comet
	$(BUILD)/comet bench

clean:
	rm -rf $(BUILD)

FORCE:

.PHONY: all test bench clean FORCE
