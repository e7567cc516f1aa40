/*
 * testutil.h - what every test file shares: the list of tests, assertions that print
 * both sides (never compiled out), the skip code, and small helpers.
 *
 * A test is `int test_NAME(void)`: it returns 0 to pass, TEST_SKIP to skip (after
 * printing why), anything else to fail. The runner runs each in its own process.
 */
#ifndef COMET_TESTUTIL_H
#define COMET_TESTUTIL_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "../harness/data.h"
#include "../harness/reference.h"

#define TEST_SKIP 77

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            printf("%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond);                        \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

#define CHECK_EQ(a, b)                                                                             \
    do {                                                                                           \
        long long a_ = (long long)(a), b_ = (long long)(b);                                        \
        if (a_ != b_) {                                                                            \
            printf("%s:%d: CHECK_EQ(%s, %s) failed: %lld != %lld\n", __FILE__, __LINE__, #a, #b, a_, b_); \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

#define CHECK_CONTAINS(haystack, needle)                                                           \
    do {                                                                                           \
        const char *h_ = (haystack), *n_ = (needle);                                               \
        if (!h_ || !strstr(h_, n_)) {                                                              \
            printf("%s:%d: \"%s\" does not contain \"%s\"\n", __FILE__, __LINE__, h_ ? h_ : "(null)", n_); \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

#define CHECK_NEAR(a, b, tol)                                                                      \
    do {                                                                                           \
        double a_ = (a), b_ = (b);                                                                 \
        if (!(a_ - b_ <= (tol) && b_ - a_ <= (tol))) {                                             \
            printf("%s:%d: CHECK_NEAR(%s, %s) failed: %.9g vs %.9g (tol %g)\n", __FILE__, __LINE__, #a, #b, \
                   a_, b_, (double)(tol));                                                         \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

/* A fresh seed per run (time and pid), printed so a failure can be replayed with
 * COMET_TEST_SEED. */
uint64_t test_seed(void);

/* All tests, in the order they run: X(name, timeout_s). */
#define COMET_TESTS(X)                          \
    X(status_strings, 10)                       \
    X(config_presets, 10)                       \
    X(config_validation, 10)                    \
    X(bf16_rounding, 10)                        \
    X(fp8_e4m3_rounding, 30)                    \
    X(fp8_scales, 10)                           \
    X(fp8_quantize_api_refusals, 10)            \
    X(fp8_segments_t_refusals, 10)              \
    X(route_plan_known_answer, 10)              \
    X(route_plan_random_invariants, 60)         \
    X(route_dispatch_messages_match, 60)        \
    X(push_slots_cover_every_partial, 60)       \
    X(route_count_rejects_bad_ids, 10)          \
    X(choice_slots, 10)                         \
    X(cost_model_knobs, 10)                     \
    X(tuning_file, 10)                          \
    X(first_wave_and_head_rules, 10)            \
    X(small_batch_schedule_rule, 10)            \
    X(tuning_file_limits, 10)                   \
    X(timeline_accounting, 10)                  \
    X(gemm_tail_plan, 10)                       \
    X(gemm_local_row_tiles, 10)                 \
    X(gemm_tile_width, 10)                      \
    X(gemm_variant_table, 10)                   \
    X(gemm_descriptions_resolve, 10)            \
    X(blaslt_fp8_layouts_and_checks, 10)        \
    X(fused_training_layers, 10)                \
    X(routing_generators, 10)                   \
    X(reference_known_answer, 10)               \
    X(reference_properties, 30)                 \
    X(reference_backward_matches_differences, 30) \
    X(launch_all_ranks_succeed, 30)             \
    X(launch_failed_rank_stops_others, 30)      \
    X(launch_crashed_rank_is_reported, 30)      \
    X(launch_timeout_stops_ranks, 30)           \
    X(launch_no_gpu_words, 30)                  \
    X(launch_external_env, 30)                  \
    X(launch_id_file_stale_run, 30)             \
    X(launch_id_file_malformed, 30)             \
    X(launch_id_file_removed_at_exit, 30)       \
    X(launch_id_file_write_errors, 30)          \
    X(launch_id_file_one_writer_wins, 60)       \
    X(api_rejects_bad_arguments, 10)            \
    X(fp8_forward_args_refusals, 10)            \
    X(saved_config_refusals, 10)                \
    X(backward_fp8_args_refusals, 10)           \
    X(swiglu_fp8_refusals, 10)                  \
    X(params_table, 30)                         \
    X(gpu_flag_wait_times_out, 60)              \
    X(gpu_gemm_every_variant, 240)              \
    X(gpu_gemm_vs_reference, 120)               \
    X(gpu_gemm_epilogues, 120)                  \
    X(gpu_gemm_last_wave_cut, 120)              \
    X(gpu_gemm_e4m3_last_wave_cut, 120)         \
    X(gpu_blaslt_fp8_grouped, 180)              \
    X(gpu_e4m3_cvt_matches_host, 120)           \
    X(gpu_quantize_fp8, 120)                    \
    X(gpu_swiglu_backward_fp8, 60)              \
    X(gpu_fp8_forward, 240)                     \
    X(gpu_fp8_training, 240)                    \
    X(gpu_fp8_training_1000_steps, 300)         \
    X(gpu_symmetric_push_pull_exact, 120)       \
    X(gpu_barrier_and_flags, 120)               \
    X(gpu_barrier_missing_peer_times_out, 120)  \
    X(gpu_route_matches_plan, 180)              \
    X(gpu_route_plan_any_world, 120)            \
    X(gpu_route_missing_peer_times_out, 120)    \
    X(gpu_route_call_mismatch_refused, 120)     \
    X(gpu_route_reports_bad_expert_id, 60)      \
    X(gpu_baseline_vs_reference, 300)           \
    X(gpu_baseline_repeated_calls, 300)         \
    X(gpu_baseline_bad_expert_id, 120)          \
    X(gpu_baseline_fp8_forward, 180)            \
    X(gpu_layer0_matches_baseline, 300)         \
    X(gpu_layer1_matches_baseline, 300)         \
    X(gpu_layer1_partial_column_tile, 120)      \
    X(gpu_layer1_missing_peer_times_out, 120)   \
    X(gpu_layer1_push_missing_peer_times_out, 120) \
    X(gpu_layer1_bad_expert_id, 120)            \
    X(gpu_layer1_tp_push_missing_peer_times_out, 120) \
    X(gpu_layer1_tp_bad_expert_id, 120)         \
    X(gpu_forward_fused_matches_baseline, 300)  \
    X(gpu_forward_tp_matches_reference, 300)    \
    X(gpu_forward_100000_calls, 300)           \
    X(gpu_forward_tp_2000_calls, 300)          \
    X(gpu_forward_graph_replay, 120)            \
    X(gpu_moe_destroy_missing_peer, 100)        \
    X(gpu_faults, 150)                          \
    X(gpu_backward_matches_reference, 300)      \
    X(gpu_backward_tp2_matches_reference, 300)  \
    X(gpu_backward_refusals, 120)               \
    X(gpu_resend_x_bound_reported, 60)          \
    X(gpu_training_1000_steps, 300)             \
    X(gpu_layers_share_a_handle, 150)           \
    X(gpu_calls_from_other_threads, 150)        \
    X(gpu_training_graph_replay, 120)           \
    X(gpu_gpt_oss_shape, 240)                   \
    X(gpu_backward_missing_peer_times_out, 120) \
    X(gpu_backward_of_another_call_refused, 120) \
    X(gpu_sequential_other_call_refused, 120) \
    X(gpu_training_forward_of_other_bounds_refused, 120) \
    X(gpu_layer_configs_differ_refused, 120)

#define DECLARE_TEST(name, timeout) int test_##name(void);
COMET_TESTS(DECLARE_TEST)
#undef DECLARE_TEST

#endif /* COMET_TESTUTIL_H */
