;; A minimal turn that ignores its input and returns "v2": a second version
;; of a plugin, for the tests that check a run keeps the version it
;; started with.
(component
  (core module $m
    (memory (export "memory") 1)
    ;; The answer's bytes at 16; the result at 32: discriminant 0 (ok),
    ;; then the string's pointer (16) and length (2).
    (data (i32.const 16) "v2")
    (data (i32.const 32) "\00\00\00\00\10\00\00\00\02\00\00\00")
    (global $next (mut i32) (i32.const 1024))
    (func (export "realloc") (param i32 i32 i32 i32) (result i32)
      (local $at i32)
      (local.set $at (global.get $next))
      (global.set $next (i32.add (global.get $next) (local.get 3)))
      (local.get $at))
    (func (export "run") (param i32 i32) (result i32) (i32.const 32)))
  (core instance $i (instantiate $m))
  (func (export "run") (param "input" string) (result (result string (error string)))
    (canon lift (core func $i "run") (memory (core memory $i "memory")) (realloc (core func $i "realloc")))))
