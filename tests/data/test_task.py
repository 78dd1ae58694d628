import pickle

import pytest

from logra_rl.data import DataConfig, Example, Task, load_task, register_task


@register_task("test_task_registry")
def _load_test_task(config: DataConfig) -> Task:
    example = Example(messages=[{"role": "user", "content": "1+1?"}], answer="2", reward="exact_match")
    return Task(name="test_task_registry", train=[example] * config.train_size, eval=[])


def test_registered_tasks_load_by_name():
    task = load_task(DataConfig(task="test_task_registry", train_size=3))
    assert (task.name, len(task.train), task.eval) == ("test_task_registry", 3, [])
    assert task.train[0].messages == ({"role": "user", "content": "1+1?"},)


def test_unknown_task_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown task 'nope'; registered tasks are \[.*'files'.*'reasoning_gym'"):
        load_task(DataConfig(task="nope"))
    with pytest.raises(ValueError, match="already registered"):
        register_task("files")(_load_test_task)


def test_a_task_without_training_examples_is_an_error():
    with pytest.raises(ValueError, match="no training examples"):
        load_task(DataConfig(task="test_task_registry", train_size=0))


def test_examples_pickle_and_serialise_to_json():
    example = Example(
        messages=({"role": "user", "content": "q"},), answer="a", reward="math_verify", metadata={"index": 1}
    )
    assert pickle.loads(pickle.dumps(example)) == example


@pytest.mark.parametrize(
    ("messages", "answer"),
    [([], "a"), ([{"role": "user"}], "a"), (["hello"], "a"), ([{"role": "user", "content": "q"}], 1)],
)
def test_malformed_examples_are_refused(messages, answer):
    with pytest.raises(ValueError, match="example"):
        Example(messages=messages, answer=answer, reward="exact_match")


@register_task("test_task_overlap")
def _load_overlapping_task(config: DataConfig) -> Task:
    def example(question: str) -> Example:
        return Example(messages=[{"role": "user", "content": question}], answer="2", reward="exact_match")

    return Task(
        name="test_task_overlap", train=[example("a"), example("b")], eval=[example(q) for q in config.val_files]
    )


def test_eval_unseen_drops_eval_questions_the_train_set_has(capsys):
    task = load_task(DataConfig(task="test_task_overlap", val_files=["b", "c", "a", "d"], eval_unseen=True))
    assert [e.messages[0]["content"] for e in task.eval] == ["c", "d"]
    assert "dropped 2 eval examples the train set also has" in capsys.readouterr().out
    assert len(load_task(DataConfig(task="test_task_overlap", val_files=["b", "c", "a", "d"])).eval) == 4
    with pytest.raises(ValueError, match="dropped every eval example: the train set has them all"):
        load_task(DataConfig(task="test_task_overlap", val_files=["a", "b"], eval_unseen=True))
