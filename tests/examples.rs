//! The examples run as tests, so that they keep working: each `main` must
//! return `Ok` (each checks what it shows, and fails otherwise).

#[allow(dead_code)]
#[path = "../examples/embed.rs"]
mod embed;

#[test]
fn the_embedding_example_gets_a_prompt_back_from_the_host_tier() {
    embed::main().expect("examples/embed.rs");
}
