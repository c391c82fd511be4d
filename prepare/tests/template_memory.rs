//! What one rendering of a hostile chat template may allocate: every way of growing a value
//! found so far is refused by name, and the rendering's peak allocation stays within twice what
//! its fuel buys (64 bytes a unit). Its own test binary, for the counting allocator.
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

use hslake_prepare::template::{ChatTemplate, TemplateSource};
use hslake_prepare::{Limits, Message, RecordError, Role};

// Bytes allocated now and at the peak, by every thread (the tests run one at a time).
struct Counting;
static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn grew(by: usize) {
    let now = NOW.fetch_add(by, Relaxed) + by;
    PEAK.fetch_max(now, Relaxed);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        unsafe { System.dealloc(p, layout) };
        NOW.fetch_sub(layout.size(), Relaxed);
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, layout, new) };
        if !q.is_null() {
            match new.checked_sub(layout.size()) {
                Some(more) => grew(more),
                None => {
                    NOW.fetch_sub(layout.size() - new, Relaxed);
                }
            }
        }
        q
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Fuel of the scaled attacks: 25.6 MB at 64 bytes a unit.
const FUEL: u64 = 400_000;

/// The result of rendering `text` under `limits`, and the bytes its rendering allocated at
/// the peak beyond what was allocated before.
fn render(text: &str, limits: Limits) -> (Result<String, RecordError>, usize) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let source = TemplateSource {
        text: text.into(),
        path: "attack.jinja".into(),
        special_tokens: vec![],
    };
    let template = ChatTemplate::new(&source, &Default::default(), &limits).unwrap();
    let messages = ChatTemplate::message_values(&[Message::new(Role::User, "hi")]).unwrap();
    let before = NOW.load(Relaxed);
    PEAK.store(before, Relaxed);
    let rendered = template.render(&messages, false).map(|r| r.text);
    let peak = PEAK.load(Relaxed).saturating_sub(before);
    (rendered, peak)
}

fn fueled() -> Limits {
    Limits {
        template_fuel: FUEL,
        ..Default::default()
    }
}

#[test]
fn the_templates_of_issue_44_are_refused_by_name() {
    // At the default bounds, as filed: past 7 GB in 5 s, and 85 MB/s without a fuel stop.
    let split = "{{ ('x' * 100000000).split('')|length }}";
    let start = std::time::Instant::now();
    let (r, peak) = render(split, Limits::default());
    println!(
        "split: {peak} bytes at the peak, refused in {:?}",
        start.elapsed()
    );
    assert_eq!(
        r.unwrap_err(),
        RecordError::Template("split: empty separator".into())
    );
    let doubling = "{% set ns=namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}";
    let start = std::time::Instant::now();
    let (r, peak) = render(doubling, Limits::default());
    println!(
        "doubling: {peak} bytes at the peak, refused in {:?}",
        start.elapsed()
    );
    let fuel = Limits::default().template_fuel;
    assert_eq!(r.unwrap_err(), RecordError::OutOfFuel { fuel });
}

#[test]
fn every_way_of_growing_a_value_stays_within_twice_what_the_fuel_buys() {
    let bound = 2 * 64 * FUEL as usize;
    for attack in [
        // Python's methods, which charge nothing of their own.
        "{{ ('x ' * 4000000).split(' ')|length }}",
        "{{ ('x\n' * 4000000).splitlines()|length }}",
        "{{ ','.join(['x' * 1000000] * 200)|length }}",
        "{{ '{:>100000000}'.format(1)|length }}",
        "{{ ('x' * 1000000).replace('', 'yyyyyyyyyy')|length }}",
        // Lazy values printed, copied or unpacked at once.
        "{{ ('' ~ (['x' * 1000000] * 200))|length }}",
        "{{ ((['x' * 1000000] * 200)|string)|length }}",
        "{% set a, b = [1] * 10000000 %}",
        "{{ ([1] * 10000000)|list|length }}",
        "{{ (range(100000)|list * 1000)|length }}",
        // Doubling: by `+`, by a list holding a value twice, by chain, sum, dict and zip.
        "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|length }}",
        "{% set ns = namespace(l=[1]) %}{% for i in range(30) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{% set x %}{{ ns.l }}{% endset %}{{ x|length }}",
        "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l|chain(ns.l) %}{% endfor %}{{ ns.l|length }}",
        "{% set ns = namespace(l=[[1]]) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l]|sum(start=[]) %}{% endfor %}{{ ns.l|length }}",
        "{% set ns = namespace(d={}) %}{% for i in range(30) %}{% set ns.d = dict(a=ns.d, b=ns.d) %}{% endfor %}{{ ns.d|string|length }}",
        "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l|zip(ns.l) %}{% endfor %}{{ ns.l|string|length }}",
        "{% macro d(l, n) %}{% if n > 0 %}{{ d(l + l, n - 1) }}{% else %}{{ l|length }}{% endif %}{% endmacro %}{{ d([1], 40) }}",
        // Strings: `~` in a loop, and output from nested loops.
        "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' }}{% endfor %}{% endfor %}",
    ] {
        let (r, peak) = render(attack, fueled());
        assert_eq!(r, Err(RecordError::OutOfFuel { fuel: FUEL }), "{attack}");
        assert!(peak < bound, "{attack}: {peak} bytes at the peak");
    }
}

#[test]
fn a_namespace_cannot_come_to_hold_itself() {
    // Printing it recursed without end: a stack overflow.
    for attack in [
        "{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}",
        "{% set ns = namespace() %}{% set ns.me = [1, {'a': ns}] %}{% set x %}{{ ns }}{% endset %}",
        "{% set a = namespace() %}{% set b = namespace(a=a) %}{% set a.b = b %}{{ a }}",
    ] {
        let (r, _) = render(attack, fueled());
        assert_eq!(
            r,
            Err(RecordError::Template(
                "a namespace cannot hold itself, directly or through other values".into()
            )),
            "{attack}"
        );
    }
}

#[test]
fn the_guard_s_names_are_not_the_template_s() {
    let source = TemplateSource {
        text: "{% set __hslake_settle = 1 %}{{ [1] + [2] }}".into(),
        path: "attack.jinja".into(),
        special_tokens: vec![],
    };
    let e = ChatTemplate::new(&source, &Default::default(), &fueled())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("uses the name prefix __hslake"), "{e}");
    let kwargs = serde_json::from_str(r#"{"__hslake_assign": 1}"#).unwrap();
    let source = TemplateSource {
        text: "{{ 1 }}".into(),
        ..source
    };
    let e = ChatTemplate::new(&source, &kwargs, &fueled())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("names starting with __hslake are hslake's own"),
        "{e}"
    );
}
